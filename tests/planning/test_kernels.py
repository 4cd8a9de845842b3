"""A fake step planned for a GPU keeps what the GPU's attention kernels keep."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from evendp._planning._measure import make_setup, measure_replica


def test_attention_with_dropout_is_planned_as_the_fused_gpu_kernel_keeps_it() -> None:
    # HF GPT-2 trains with attn_pdrop=0.1: on a CPU, SDPA with dropout takes the math path
    # and saves every heads x T x T matrix; CUDA's fused kernels save none of them.
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=128)
    ids = torch.zeros(1, 128, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}

    def activations(gpu: bool) -> float:
        setup = make_setup(lambda: GPT2LMHeadModel(cfg), batch, None, None, None, False)
        setup.gpu = gpu
        return measure_replica(setup, 4, "keep").forward_end["activations"]

    cpu, gpu = activations(False), activations(True)
    # The math path's saved attention (softmax out and dropout's mask and output, fp32 and
    # bool) per layer: 4 samples x 4 heads x 128 x 128 x 9 bytes at least.
    assert cpu - gpu >= 2 * 4 * 4 * 128 * 128 * 9
