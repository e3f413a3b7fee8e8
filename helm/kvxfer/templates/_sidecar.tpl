{{/*
Named templates for an engine's own chart: include "kvxfer.sidecar" under the pod's
initContainers, "kvxfer.volumes" under its volumes and "kvxfer.engineMounts" under the
engine container's volumeMounts; render this chart with engine.enabled=false for the
ConfigMap, Secret and monitoring objects they refer to.
*/}}

{{- define "kvxfer.probe" -}}
exec:
  command: ["kvxfer", "health", "--target", "unix:{{ include "kvxfer.socketPath" . }}", "--timeout", "2"]
{{- end -}}

{{/* The kvxfer container: a native sidecar (an init container that keeps running). */}}
{{- define "kvxfer.sidecar" -}}
- name: kvxfer
  image: {{ include "kvxfer.image" . }}
  imagePullPolicy: {{ .Values.kvxfer.image.pullPolicy }}
  restartPolicy: Always
  args: ["serve", "--config", "/etc/kvxfer/config/kvxfer.yaml"]
  ports:
    - {name: metrics, containerPort: {{ include "kvxfer.metricsPort" . }}, protocol: TCP}
    {{- if .Values.kvxfer.tcp.enabled }}
    - {name: grpc-tls, containerPort: {{ .Values.kvxfer.tcp.port }}, protocol: TCP}
    {{- end }}
    {{- if .Values.kvxfer.events.enabled }}
    - {name: kv-events, containerPort: {{ .Values.kvxfer.events.port }}, protocol: TCP}
    - {name: kv-events-replay, containerPort: {{ .Values.kvxfer.events.replayPort }}, protocol: TCP}
    {{- end }}
  env:
    # Triton compiles its kernels and their launcher at run time into its home: a volume, since
    # the root filesystem is read-only (the image keeps the C compiler the launcher needs).
    - {name: TRITON_HOME, value: /var/cache/kvxfer}
    - {name: TRITON_CACHE_DIR, value: /var/cache/kvxfer/triton}
    {{- if eq .Values.gpu.mode "devicePlugin" }}
    # The engine holds the GPU through the device plugin; this container sees every GPU of the
    # node and serves the engine's by its UUID (docs/gpu.md: the security cost).
    - {name: NVIDIA_VISIBLE_DEVICES, value: all}
    - {name: NVIDIA_DRIVER_CAPABILITIES, value: "compute,utility"}
    {{- end }}
    {{- with .Values.kvxfer.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  startupProbe:
    {{- include "kvxfer.probe" . | nindent 4 }}
    {{- toYaml .Values.kvxfer.startupProbe | nindent 4 }}
  readinessProbe:
    {{- include "kvxfer.probe" . | nindent 4 }}
    {{- toYaml .Values.kvxfer.readinessProbe | nindent 4 }}
  livenessProbe:
    {{- include "kvxfer.probe" . | nindent 4 }}
    {{- toYaml .Values.kvxfer.livenessProbe | nindent 4 }}
  resources:
    {{- $res := deepCopy .Values.kvxfer.resources -}}
    {{- $memory := printf "%sMi" (include "kvxfer.memoryMiB" .) -}}
    {{- range $part := list "requests" "limits" -}}
    {{- $given := default dict (get $res $part) -}}
    {{- if not (hasKey $given "memory") -}}
    {{- $_ := set $given "memory" $memory -}}
    {{- end -}}
    {{- $_ := set $res $part $given -}}
    {{- end -}}
    {{- toYaml $res | nindent 4 }}
    {{- include "kvxfer.draClaims" . | nindent 4 }}
  securityContext:
    runAsNonRoot: true
    runAsUser: {{ .Values.kvxfer.runAsUser }}
    runAsGroup: {{ .Values.kvxfer.fsGroup }}
    readOnlyRootFilesystem: true
    allowPrivilegeEscalation: false
    capabilities: {drop: [ALL]}
    seccompProfile: {type: RuntimeDefault}
  volumeMounts:
    - {name: kvxfer-socket, mountPath: {{ .Values.kvxfer.socketDir }}}
    - {name: kvxfer-shm, mountPath: /dev/shm}
    - {name: kvxfer-config, mountPath: /etc/kvxfer/config, readOnly: true}
    - {name: kvxfer-tmp, mountPath: /tmp}
    - {name: kvxfer-cache, mountPath: /var/cache/kvxfer}
    {{- if .Values.kvxfer.tcp.enabled }}
    - {name: kvxfer-tls, mountPath: /etc/kvxfer/tls, readOnly: true}
    {{- end }}
    {{- if or .Values.kvxfer.tcp.enabled .Values.kvxfer.token.existingSecret .Values.kvxfer.token.value }}
    - {name: kvxfer-token, mountPath: /etc/kvxfer/token, readOnly: true}
    {{- end }}
    {{- if and .Values.kvxfer.mooncake.enabled .Values.kvxfer.mooncake.secretName }}
    - {name: kvxfer-mooncake, mountPath: /etc/kvxfer/mooncake, readOnly: true}
    {{- end }}
    {{- with .Values.kvxfer.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* The pod's volumes for the sidecar and the engine. */}}
{{- define "kvxfer.volumes" -}}
- name: kvxfer-socket
  emptyDir: {}
- name: kvxfer-shm
  emptyDir: {medium: Memory, sizeLimit: {{ include "kvxfer.shmSizeMiB" . }}Mi}
- name: kvxfer-tmp
  emptyDir: {sizeLimit: 64Mi}
- name: kvxfer-cache
  emptyDir: {sizeLimit: 256Mi}
- name: kvxfer-config
  configMap: {name: {{ include "kvxfer.fullname" . }}-config}
{{- if .Values.kvxfer.tcp.enabled }}
- name: kvxfer-tls
  secret:
    secretName: {{ include "kvxfer.tlsSecretName" . }}
{{- end }}
{{- if or .Values.kvxfer.tcp.enabled .Values.kvxfer.token.existingSecret .Values.kvxfer.token.value }}
- name: kvxfer-token
  secret:
    secretName: {{ .Values.kvxfer.token.existingSecret | default (include "kvxfer.secretName" .) }}
    items: [{key: token, path: token}]
{{- end }}
{{- if and .Values.kvxfer.mooncake.enabled .Values.kvxfer.mooncake.secretName }}
- name: kvxfer-mooncake
  secret:
    secretName: {{ .Values.kvxfer.mooncake.secretName }}
    items: [{key: secret, path: secret}]
{{- end }}
{{- with .Values.kvxfer.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* What the engine container mounts: the socket directory and /dev/shm. */}}
{{- define "kvxfer.engineMounts" -}}
- {name: kvxfer-socket, mountPath: {{ .Values.kvxfer.socketDir }}}
- {name: kvxfer-shm, mountPath: /dev/shm}
{{- end -}}
