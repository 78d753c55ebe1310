"""The peer's side of the CPU generation benchmark (``lab/benchmarks/generate_peer.py``):
transformers' ``generate``, greedy, as a worker process.

    python scripts/peer_generate.py MODEL_DIR NEW_TOKENS --threads 2 --experts-implementation eager

Run under any Python with torch and transformers (not the project's environment, which has no
torch); the driver starts it and speaks to it over stdin/stdout, one JSON object a line: first
``{"ready": ...}`` (versions, threads, parameter count, the attention and experts'
implementations), then, for each ``{"steps": n}`` it reads, ``n`` calls of
``model.generate(prompts, max_new_tokens=NEW_TOKENS, do_sample=False)`` on the directory's
``prompts.json`` with no end token (every call makes ``NEW_TOKENS`` tokens a row), answered
with ``{"times": [...], "cpu_times": [...], "generated": [[...], ...]}`` (wall and process CPU
seconds per call; the last call's new tokens); end of input ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("new_tokens", type=int)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--experts-implementation", default="",
                        help="transformers' experts kernel: eager | grouped_mm | batched_mm "
                             "(default: transformers' choice)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    if args.experts_implementation:
        model.set_experts_implementation(args.experts_implementation)
    with open(os.path.join(args.model_dir, "prompts.json")) as f:
        prompts = torch.tensor(json.load(f), dtype=torch.long)
    mask = torch.ones_like(prompts)

    def call() -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(prompts, attention_mask=mask, max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)

    reply({"ready": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "threads": torch.get_num_threads(),
                     "num_params": sum(p.numel() for p in model.parameters()),
                     "experts_implementation": model.config._experts_implementation,
                     "attention_implementation": model.config._attn_implementation}})
    out = None
    for line in sys.stdin:
        times, cpu_times = [], []
        for _ in range(json.loads(line)["steps"]):
            start, cpu_start = time.perf_counter(), time.process_time()
            out = call()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        generated = [] if out is None else out[:, prompts.shape[1]:].tolist()
        reply({"times": times, "cpu_times": cpu_times, "generated": generated})


def reply(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


if __name__ == "__main__":
    main()
