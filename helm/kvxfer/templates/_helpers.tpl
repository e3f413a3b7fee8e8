{{/* Names and labels. */}}
{{- define "kvxfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvxfer.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "kvxfer.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvxfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvxfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvxfer.labels" -}}
{{ include "kvxfer.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvxfer.socketPath" -}}
{{- printf "%s/kvxfer.sock" .Values.kvxfer.socketDir -}}
{{- end -}}

{{- /* The port of metrics_listen: after its last ":" (an IPv6 host such as [::] has its own) */}}
{{- define "kvxfer.metricsPort" -}}
{{- regexReplaceAll "^.*:" .Values.kvxfer.config.metrics_listen "" | int -}}
{{- end -}}

{{- /* "true" where the Prometheus Operator's API is there (or is said to be): else ServiceMonitor and
PrometheusRule are left out, and the install does not fail on a cluster without the operator */}}
{{- define "kvxfer.hasOperator" -}}
{{- if or .Values.monitoring.assumeOperator (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") -}}
true
{{- end -}}
{{- end -}}

{{/* Peering: the StatefulSet's pods, by name (stable), and the headless Service that gives each a DNS name. */}}
{{- define "kvxfer.peerPods" -}}
{{- $pods := list -}}
{{- range $i := until (int .Values.engine.replicas) -}}
{{- $pods = append $pods (printf "%s-%d" (include "kvxfer.fullname" $) $i) -}}
{{- end -}}
{{- toYaml $pods -}}
{{- end -}}

{{- define "kvxfer.peersService" -}}
{{- printf "%s-peers" (include "kvxfer.fullname" .) -}}
{{- end -}}

{{- define "kvxfer.peering" -}}
{{- and .Values.kvxfer.peering.enabled .Values.engine.enabled -}}
{{- end -}}

{{/* The TCP listener's TLS Secret: given, issued by cert-manager for the peers, or made from inline PEM. */}}
{{- define "kvxfer.tlsSecretName" -}}
{{- $k := .Values.kvxfer -}}
{{- if $k.tcp.existingTlsSecret -}}
{{- $k.tcp.existingTlsSecret -}}
{{- else if and $k.peering.enabled $k.peering.certManager.issuerRef.name -}}
{{- printf "%s-peers-tls" (include "kvxfer.fullname" .) -}}
{{- else -}}
{{- printf "%s-tls" (include "kvxfer.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "kvxfer.secretName" -}}
{{- printf "%s-secret" (include "kvxfer.fullname" .) -}}
{{- end -}}

{{/* The daemon's config file: the values' config plus what the chart decides (socket, TLS, token). */}}
{{- define "kvxfer.config" -}}
{{- $c := deepCopy .Values.kvxfer.config -}}
{{- $_ := set $c "socket" (include "kvxfer.socketPath" .) -}}
{{- $_ := set $c "socket_mode" "0660" -}}
{{- $_ := set $c "socket_group" (toString .Values.kvxfer.fsGroup) -}}
{{- $ranks := int .Values.kvxfer.registeredPools -}}
{{- $own := len (default (list) $c.pools) -}}
{{- $allowed := or (not (hasKey $c "allow_register")) $c.allow_register -}}
{{- if not (hasKey $c "registered_ranks") -}}
{{- /* The memory check at start counts these ranks' host tiers (docs/configuration.md). */ -}}
{{- $_ := set $c "registered_ranks" (ternary $ranks 0 $allowed) -}}
{{- end -}}
{{- /* Each rank's pool gets a cache group; each SGLang rank registers two pools (its host pool, a staging area). */ -}}
{{- $perRank := ternary 2 1 (and .Values.engine.enabled (eq .Values.engine.kind "sglang")) -}}
{{- if not (hasKey $c "max_pools") -}}
{{- $_ := set $c "max_pools" (max 8 (add (mul $perRank $ranks) $own)) -}}
{{- end -}}
{{- if not (hasKey $c "max_cache_groups") -}}
{{- $_ := set $c "max_cache_groups" (max 8 (add $ranks $own)) -}}
{{- end -}}
{{- if .Values.kvxfer.tcp.enabled -}}
{{- $_ := set $c "listen" (printf "0.0.0.0:%d" (int .Values.kvxfer.tcp.port)) -}}
{{- $_ := set $c "tls_cert" "/etc/kvxfer/tls/tls.crt" -}}
{{- $_ := set $c "tls_key" "/etc/kvxfer/tls/tls.key" -}}
{{- end -}}
{{- if or .Values.kvxfer.tcp.enabled .Values.kvxfer.token.existingSecret .Values.kvxfer.token.value -}}
{{- $_ := set $c "token_file" "/etc/kvxfer/token/token" -}}
{{- end -}}
{{- if .Values.kvxfer.mooncake.enabled -}}
{{- $m := .Values.kvxfer.mooncake -}}
{{- $mc := deepCopy (default (dict) $c.mooncake) -}}
{{- $_ := set $mc "master" (required "kvxfer.mooncake.master is required with kvxfer.mooncake.enabled" $m.master) -}}
{{- $_ := set $mc "metadata" (required "kvxfer.mooncake.metadata is required with kvxfer.mooncake.enabled" $m.metadata) -}}
{{- $_ := set $mc "protocol" $m.protocol -}}
{{- $_ := set $mc "segment_mib" (int $m.segmentMiB) -}}
{{- $_ := set $mc "buffer_mib" (int $m.bufferMiB) -}}
{{- if $m.secretName }}{{ $_ := set $mc "secret_file" "/etc/kvxfer/mooncake/secret" }}{{ end -}}
{{- $_ := set $c "mooncake" $mc -}}
{{- end -}}
{{- if .Values.kvxfer.events.enabled -}}
{{- $e := deepCopy (default (dict) $c.events) -}}
{{- $_ := set $e "publish" (printf "tcp://*:%d" (int .Values.kvxfer.events.port)) -}}
{{- $_ := set $e "replay" (printf "tcp://*:%d" (int .Values.kvxfer.events.replayPort)) -}}
{{- $_ := set $c "events" $e -}}
{{- end -}}
{{- if .Values.kvxfer.peering.enabled -}}
{{- $p := .Values.kvxfer.peering -}}
{{- $ca := printf "/etc/kvxfer/tls/%s" $p.caKey -}}
{{- $peers := list -}}
{{- $own := ternary (include "kvxfer.peerPods" . | fromYamlArray) (list) (eq (include "kvxfer.peering" .) "true") -}}
{{- range $pod := $own -}}
{{- $peers = append $peers (dict "name" $pod "address" (printf "%s.%s.%s.svc:%d" $pod (include "kvxfer.peersService" $) $.Release.Namespace (int $.Values.kvxfer.tcp.port)) "server_name" $pod "tls_ca" $ca "token_file" "/etc/kvxfer/token/token") -}}
{{- end -}}
{{- range $p.peers -}}
{{- $peers = append $peers (dict "name" .name "address" .address "tls_ca" $ca "token_file" "/etc/kvxfer/token/token") -}}
{{- end -}}
{{- $e := deepCopy (default (dict) $c.peering) -}}
{{- $_ := set $e "name" $p.name -}}
{{- $_ := set $e "peers" $peers -}}
{{- $_ := set $e "tls_client_ca" $ca -}}
{{- if $p.ucxTls }}{{ $_ := set $e "ucx_tls" $p.ucxTls }}{{ end -}}
{{- if $p.ucxNetDevices }}{{ $_ := set $e "ucx_net_devices" $p.ucxNetDevices }}{{ end -}}
{{- if ne $p.ucxModules nil }}{{ $_ := set $e "ucx_modules" $p.ucxModules }}{{ end -}}
{{- $_ := set $c "peering" $e -}}
{{- end -}}
{{- toYaml $c -}}
{{- end -}}

{{/* MiB of /dev/shm: every pool's bytes and host tier, the registered pools' tiers, a margin. */}}
{{- define "kvxfer.shmSizeMiB" -}}
{{- $sizes := dict "float16" 2 "bfloat16" 2 "float32" 4 "float8_e4m3fn" 1 "float8_e5m2" 1 "int8" 1 "uint8" 1 -}}
{{- $total := int .Values.kvxfer.shmMarginMiB -}}
{{- range .Values.kvxfer.config.pools -}}
{{- $s := .spec -}}
{{- $bytes := mul $s.num_layers $s.num_blocks $s.block_size $s.num_kv_heads $s.head_size 2 (get $sizes $s.dtype) -}}
{{- $total = add $total (div (add $bytes 1048575) 1048576) (int (ceil .host_capacity_mib)) -}}
{{- end -}}
{{- $registered := int (default 512 .Values.kvxfer.config.registered_host_capacity_mib) -}}
{{- $total = add $total (mul $registered (int .Values.kvxfer.registeredPools)) -}}
{{- $total -}}
{{- end -}}

{{/* MiB of the sidecar's memory: its own CPU pools and every host tier (the registered ranks' too),
     all anonymous memory or memfds charged to its cgroup, plus the process itself (docs/configuration.md). */}}
{{- define "kvxfer.memoryMiB" -}}
{{- $sizes := dict "float16" 2 "bfloat16" 2 "float32" 4 "float8_e4m3fn" 1 "float8_e5m2" 1 "int8" 1 "uint8" 1 -}}
{{- $c := fromYaml (include "kvxfer.config" .) -}}
{{- $total := int .Values.kvxfer.processMemoryMiB -}}
{{- range $c.pools -}}
{{- $s := .spec -}}
{{- if or (eq (toString .device) "cpu") (and (eq $.Values.gpu.mode "none") (not .device)) -}}
{{- $bytes := mul $s.num_layers $s.num_blocks $s.block_size $s.num_kv_heads $s.head_size (default 2 $s.kv_parts) (get $sizes $s.dtype) -}}
{{- $total = add $total (div (add $bytes 1048575) 1048576) -}}
{{- end -}}
{{- $total = add $total (int (ceil (default 512 .host_capacity_mib))) -}}
{{- end -}}
{{- $total = add $total (mul (int (default 512 $c.registered_host_capacity_mib)) (int $c.registered_ranks)) -}}
{{- with $c.mooncake -}}{{/* lent to the cluster and the transfer buffer, by each cache group's client */}}
{{- $groups := add (len $c.pools) (int $c.registered_ranks) -}}
{{- $total = add $total (mul $groups (add (int (default 0 .segment_mib)) (int (default 64 .buffer_mib)))) -}}
{{- end -}}
{{- $total -}}
{{- end -}}

{{- define "kvxfer.image" -}}
{{- $i := .Values.kvxfer.image -}}
{{- $variant := ternary $i.variant "cuda" (eq .Values.gpu.mode "none") -}}
{{- printf "%s:%s-%s" $i.repository $i.tag $variant -}}
{{- end -}}

{{/* The --kv-transfer-config vLLM needs for this sidecar (docs/vllm.md). */}}
{{- define "kvxfer.kvTransferConfig" -}}
{{- dict "kv_connector" "KvxferConnector" "kv_connector_module_path" "kvxfer.integrations.vllm" "kv_role" "kv_both" "kv_load_failure_policy" "recompute" "kv_connector_extra_config" (dict "socket" (include "kvxfer.socketPath" .)) | toJson -}}
{{- end -}}

{{/* SGLang's HiCache storage backend: the kvxfer sidecar, the host pool in a memfd the sidecar reads in place. */}}
{{- define "kvxfer.hicacheConfig" -}}
{{- dict "backend_name" "kvxfer" "module_path" "kvxfer.integrations.sglang" "class_name" "KvxferStore" "interface_v1" 1 "allocator" "shm" "socket" (include "kvxfer.socketPath" .) | toJson -}}
{{- end -}}

{{/* The engine's command line: the model, its port and the flags that point it at the sidecar. */}}
{{- define "kvxfer.engineArgs" -}}
{{- $e := .Values.engine -}}
{{- if eq $e.kind "sglang" }}
- python3
- -m
- sglang.launch_server
- --model-path
- {{ $e.model | quote }}
- --port
- {{ $e.port | quote }}
- --enable-hierarchical-cache
- --hicache-storage-backend
- dynamic
- --hicache-storage-backend-extra-config
- {{ include "kvxfer.hicacheConfig" . | quote }}
{{- else }}
- {{ $e.model | quote }}
- --port
- {{ $e.port | quote }}
- --kv-transfer-config
- {{ include "kvxfer.kvTransferConfig" . | quote }}
{{- end }}
{{- range $e.args }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The GPU claim a container joins (gpu.mode dra). */}}
{{- define "kvxfer.draClaims" -}}
{{- if eq .Values.gpu.mode "dra" }}
claims:
  - name: gpu
{{- end }}
{{- end -}}
