"""One vLLM engine run for the interop tests: `python vllm_job.py JOB.json RESULT.json` (see vllm_engine.run_vllm).

Greedy, float32 unless the job says otherwise, the engine in this process; writes the outputs and the spec-decode counters of `LLM.get_metrics()`.
"""

import json
import os
import sys


class _InterpretedCpuBackend:
    """A stand-in for the CPU backend of Triton that vLLM looks for (see `use_triton_interpreter`)."""

    compiler = None

    class driver:
        @staticmethod
        def is_active() -> bool:
            return True


def use_triton_interpreter() -> None:
    """vLLM 0.32 serves DSpark only on its V2 model runner (and Gemma 4's centroid head only there on a CPU: its V1
    runner records CUDA graphs of it), which a CPU build enables only where Triton has a CPU backend (triton-cpu,
    which PyPI does not carry): vllm/triton_utils/importing.py looks for "cpu" among triton.backends. Declare one,
    and run every Triton kernel of the runner through Triton's interpreter (numpy, on the CPU tensors): vLLM's own
    code end to end, its kernels interpreted instead of compiled. Must run before vLLM (and any @triton.jit) is
    imported."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    from triton import backends

    backends.backends.setdefault("cpu", _InterpretedCpuBackend())


def main() -> int:
    job = json.load(open(sys.argv[1]))
    if job.get("triton_interpreter"):
        use_triton_interpreter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"] or job["target"], dtype=job.get("dtype", "float32"), max_model_len=1024, enforce_eager=True, seed=0,
              speculative_config=job["speculative_config"], disable_log_stats=False,
              **({"max_num_seqs": job["max_num_seqs"]} if job.get("max_num_seqs") else {}))
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]],
                           SamplingParams(temperature=0.0, max_tokens=job["max_tokens"]), use_tqdm=False)
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_"):
            key = metric.name.removeprefix("vllm:spec_decode_")
            counters[key] = list(metric.values) if hasattr(metric, "values") else int(metric.value)
    with open(sys.argv[2], "w") as f:
        json.dump({"outputs": [list(r.outputs[0].token_ids) for r in results], "counters": counters}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
