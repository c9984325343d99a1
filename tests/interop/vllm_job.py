"""One vLLM engine run for the interop tests: `python vllm_job.py JOB.json RESULT.json` (see vllm_engine.run_vllm).

Greedy, float32 unless the job says otherwise, the engine in this process; writes the outputs and the spec-decode counters of `LLM.get_metrics()`.
"""

import json
import sys


def main() -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.load(open(sys.argv[1]))
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
