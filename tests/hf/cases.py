"""The ZeRO layouts the Trainer tests run (zero_optimization sections), shared so every file covers the same set;
the tiny Llama the accelerate loops load."""

ZERO_CASES = {
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage3_cpu_offload": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                           "offload_param": {"device": "cpu", "pin_memory": False}},
}


_SAVED: dict = {}


def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny Llama's initial weights, saved once per session: both sides of a comparison load them, whatever ZeRO-3
    init does to a fresh model's RNG."""
    if "llama" not in _SAVED:
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        where = str(tmp_path_factory.mktemp("initial_model"))
        AutoModelForCausalLM.from_config(config).save_pretrained(where)
        _SAVED["llama"] = where
    return _SAVED["llama"]


def write_json(path: str, obj) -> None:
    """For a file every rank writes: atomically (a temp file of this process, then a rename), so no rank reads a
    copy another rank has just truncated (open("w") from each rank gave one an empty ds_config: JSONDecodeError)."""
    import json
    import os
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def fresh_accelerate() -> None:
    """accelerate's process-wide state reset, so a rank forked after another run builds its Accelerator anew."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def loop_result(out: str, rank: int):
    """What the accelerate loop saved (rank 0's result.pt, our own file), or None on the other ranks."""
    import os

    import torch
    return torch.load(os.path.join(out, "result.pt"), weights_only=True) if rank == 0 else None
