"""The ZeRO layouts the Trainer tests run (zero_optimization sections), shared so every file covers the same set."""

ZERO_CASES = {
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage3_cpu_offload": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                           "offload_param": {"device": "cpu", "pin_memory": False}},
}
