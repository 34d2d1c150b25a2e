"""Megatron-Core's GPT on one GPU, bf16, the step of benches/pytorch/gpt_train.py.

The comparison row of benches/gpu/run.sh: Megatron-Core's `GPTModel` with its plain-PyTorch
layer spec (`get_gpt_layer_local_spec`: no Transformer Engine, no Apex), learned absolute
positions, LayerNorm, GeLU, tied embeddings, no dropout; Megatron's own bf16 recipe
(`Float16Module` over bf16 parameters, fp32 main gradients in the DDP buffer, fp32 master
weights in `get_megatron_optimizer`'s Adam with decoupled weight decay, clipping at 1.0),
one micro-batch per step through `get_forward_backward_func`. The vocabulary is padded to
a multiple of 128 as Megatron-LM pads it (50257 -> 50304); the tokens are the same
synthetic ones as gpt_train.py's (below 50257).

Writes the same JSON lines as gpt_train.py (one per step, then a summary), so
benches/gpu/report.py reads both. Megatron-Core comes from the wheel that
scripts/gpu-bundle.sh unpacks into gpu-bundle/python (on PYTHONPATH via its env.sh).
"""

import argparse
import json
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pytorch"))
from gpt_train import lr_at, synthetic_batch  # noqa: E402


def padded_vocab(vocab: int, multiple: int = 128) -> int:
    return (vocab + multiple - 1) // multiple * multiple


def init_single_gpu() -> None:
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group(backend="nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def build(a):
    """The model (bf16 parameters under Float16Module, in Megatron's DDP wrapper) and
    Megatron's mixed-precision optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(a.seed)
    config = TransformerConfig(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        ffn_hidden_size=4 * a.hidden, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="LayerNorm", layernorm_epsilon=1e-5, add_bias_linear=True,
        gated_linear_unit=False, activation_func=F.gelu, init_method_std=0.02,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=padded_vocab(a.vocab), max_sequence_length=a.seq,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True).cuda()
    model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=a.lr, weight_decay=a.weight_decay,
                        adam_beta1=a.beta1, adam_beta2=a.beta2, adam_eps=a.adam_eps,
                        bf16=True, params_dtype=torch.bfloat16, clip_grad=a.grad_clip,
                        use_distributed_optimizer=False),
        [model])
    return model, opt


def forward_step(batch, data_iterator, model):
    ids, targets = batch
    b, s = ids.shape
    positions = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s)
    per_token = model(ids, positions, None, labels=targets)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    return per_token, loss_func


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("vocab", 50257), ("layers", 12), ("hidden", 768), ("heads", 12),
                          ("seq", 1024), ("batch", 8), ("steps", 12), ("warmup", 2),
                          ("seed", 1234)]:
        p.add_argument(f"--{name}", type=int, default=default)
    # gpt_train.py's defaults, so both follow the same schedule.
    for name, default in [("lr", 3e-3), ("min-lr", 3e-4), ("weight-decay", 0.01),
                          ("beta1", 0.9), ("beta2", 0.95), ("adam-eps", 1e-8),
                          ("grad-clip", 1.0)]:
        p.add_argument(f"--{name}", type=float, default=default)
    p.add_argument("--out", required=True, help="JSON lines, one per step, then a summary")
    a = p.parse_args()
    out = open(a.out, "w")
    try:
        run(a, out)
    except Exception as e:  # the row reads "failed"; the reason goes to the log and summary
        traceback.print_exc()
        out.write(json.dumps({"summary": True, "error": f"{type(e).__name__}: {e}"}) + "\n")
        out.close()
        sys.exit(1)


def run(a, out):
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    import megatron.core

    init_single_gpu()
    model, opt = build(a)
    forward_backward = get_forward_backward_func()
    tokens = a.batch * a.seq
    t_all = time.perf_counter()
    for step in range(a.steps):
        t0 = time.perf_counter()
        ids, targets = synthetic_batch(a.seed, a.vocab, step, 0, a.batch, a.seq)
        batch = (ids.cuda(), targets.cuda())
        for g in opt.param_groups:
            g["lr"] = lr_at(a, step)
        model.zero_grad_buffer()
        opt.zero_grad()
        losses = forward_backward(
            forward_step_func=partial(forward_step, batch), data_iterator=iter([None]),
            model=[model], num_microbatches=1, seq_length=a.seq, micro_batch_size=a.batch,
            decoder_seq_length=a.seq, forward_only=False)
        finalize_model_grads([model])
        _, norm, _ = opt.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        loss = float(losses[0]["lm loss"]) if losses else float("nan")
        out.write(json.dumps({
            "step": step + 1, "loss": loss, "lr": lr_at(a, step),
            "grad_norm": float(norm) if norm is not None else None,
            "step_time_s": dt, "tokens_per_s": tokens / dt}) + "\n")
        out.flush()
    out.write(json.dumps({
        "summary": True, "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20,
        "peak_gpu_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
        "device": "cuda", "precision": "bf16", "wall_s": time.perf_counter() - t_all,
        "torch": torch.__version__,
        "megatron_core": getattr(megatron.core, "__version__", "?")}) + "\n")
    out.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
