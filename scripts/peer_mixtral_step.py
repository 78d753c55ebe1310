"""The peer's side of the CPU benchmark against transformers (``lab/benchmarks/cpu_peer.py``):
transformers' ``MixtralForCausalLM`` training step with PyTorch's AdamW, as a worker process.

Run under any Python with torch and transformers (not the project's environment, which has no
torch); the driver starts it and speaks to it over stdin/stdout, one JSON object a line:

    python -m experiments.cpu_peer --peer-python /path/to/torchenv/bin/python

It answers first ``{"ready": ...}`` (versions, threads, parameter count, the experts'
implementation), then, for each ``{"steps": n}`` it reads, runs ``n`` training steps and
answers ``{"times": [...], "cpu_times": [...], "loss": ...}`` (wall and process CPU seconds
per step); end of input ends it.

The model and the step mirror the project's (``configs/lm_quickstart.py`` with the sizes
given in ``--sizes``, a JSON object of ``lab.benchmarks.lm_step`` sizes): Mixtral's top-2
softmax routing renormalised over the two chosen, no jitter, SwiGLU experts, the load-balancing
loss at weight 0.01, float32, the loss the mean next-token NLL of every row's positions; AdamW
(b2 0.98, weight decay 0.01 on matrices only), the gradient clipped to norm 1.0, a linear
warm-up and decay of the learning rate. One step: zero the gradients, forward, backward, clip,
optimizer step, schedule step. ``torch.set_num_threads(--threads)``; the experts' kernel
is transformers' choice unless ``--experts-implementation`` names one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import transformers
from transformers import MixtralConfig, MixtralForCausalLM


def build(sizes: dict[str, int]) -> MixtralForCausalLM:
    config = MixtralConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["emb"], intermediate_size=sizes["mlp"],
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"],
        num_key_value_heads=sizes["kv_heads"], num_local_experts=sizes["experts"],
        num_experts_per_tok=sizes["top_k"], max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.02, tie_word_embeddings=False, router_jitter_noise=0.0,
        output_router_logits=True, router_aux_loss_coef=0.01, sliding_window=None,
        attention_dropout=0.0, torch_dtype="float32")
    return MixtralForCausalLM(config)


def optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    """AdamW as ``configs/lm_quickstart.py`` sets it, and its linear schedule."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.01},
                             {"params": others, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.98), eps=1e-8)
    warmup, decay = 30, 300
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (decay - s) / (decay - warmup))))
    return opt, schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", required=True, help="JSON object of the benchmark's sizes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--experts-implementation", default="",
                        help="transformers' experts kernel: eager | grouped_mm | batched_mm "
                             "(default: transformers' choice)")
    args = parser.parse_args()
    sizes = json.loads(args.sizes)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build(sizes)
    if args.experts_implementation:
        model.set_experts_implementation(args.experts_implementation)
    model.train()
    opt, schedule = optimizer(model)
    rows = sizes["tokens"] // sizes["length"]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, sizes["vocab"], (rows, sizes["length"]), generator=generator)
    tokens[:, 0] = 1

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        return loss.item()

    reply({"ready": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "threads": torch.get_num_threads(),
                     "num_params": sum(p.numel() for p in model.parameters()),
                     "experts_implementation": model.config._experts_implementation,
                     "attention_implementation": model.config._attn_implementation}})
    for line in sys.stdin:
        times, cpu_times, loss = [], [], float("nan")
        for _ in range(json.loads(line)["steps"]):
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = step()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        reply({"times": times, "cpu_times": cpu_times, "loss": loss})


def reply(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


if __name__ == "__main__":
    main()
