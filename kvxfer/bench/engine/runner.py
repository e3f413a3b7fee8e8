"""One real vLLM engine (``vllm.LLM`` on vLLM's CPU build) driven over a pipe: the process
``EngineProcess`` starts. Run as ``python -m kvxfer.bench.engine.runner SPEC_JSON RESULT_FD``.

Each line on stdin is a request (JSON); each answer is one JSON line on RESULT_FD (vLLM logs to
stdout and stderr, so answers have a pipe of their own). Requests run one at a time, greedy, with
``ignore_eos``: the same prompt gives the same tokens unless the KV it reads differs."""

from __future__ import annotations

import json
import os
import sys
import time


def build_engine(spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if spec.get("kvxfer") is not None:
        transfer = KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm",
                                    kv_role="kv_both", kv_load_failure_policy="recompute",
                                    kv_connector_extra_config=spec["kvxfer"])
    block_size, blocks = spec["block_size"], spec["num_blocks"]
    return LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype=spec.get("dtype", "bfloat16"),
               block_size=block_size, num_gpu_blocks_override=blocks, kv_cache_memory_bytes=spec["kv_cache_bytes"],
               max_model_len=spec["max_model_len"], max_num_batched_tokens=spec.get("max_batched_tokens", 2048),
               max_num_seqs=spec.get("max_num_seqs", 8), enable_prefix_caching=True, kv_transfer_config=transfer,
               kv_cache_dtype=spec.get("kv_cache_dtype", "auto"), seed=0, disable_log_stats=False)


def run_one(llm, request: dict) -> dict:
    """Generate for one request; its tokens, their logprobs, the cached prompt tokens and its TTFT."""
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": request["prompt"]}
    if request.get("cache_salt"):
        prompt["cache_salt"] = request["cache_salt"]
    params = SamplingParams(max_tokens=request.get("max_tokens", 8), temperature=0.0, logprobs=0, ignore_eos=True,
                            extra_args=({"kv_transfer_params": request["kv_transfer_params"]}
                                        if request.get("kv_transfer_params") else None))
    start = time.perf_counter()
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - start
    completion = out.outputs[0]
    logprobs = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
    metrics = out.metrics
    ttft = getattr(metrics, "first_token_latency", 0.0) or wall
    return {"tokens": list(completion.token_ids), "logprobs": logprobs, "cached": out.num_cached_tokens or 0,
            "ttft_s": ttft, "wall_s": wall}


def serve(spec: dict, answers) -> None:
    llm = build_engine(spec)
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        op = request.get("op", "generate")
        if op == "generate":
            answer = run_one(llm, request)
        elif op == "reset":  # drop the engine's own prefix cache (kvxfer's copies stay)
            answer = {"reset": bool(llm.reset_prefix_cache())}
        elif op == "exit":
            break
        else:
            answer = {"error": f"unknown op {op!r}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    del llm


if __name__ == "__main__":  # vLLM spawns processes: everything runs under this guard
    spec_arg, fd = sys.argv[1], int(sys.argv[2])
    with os.fdopen(fd, "w") as out:
        serve(json.loads(spec_arg), out)
