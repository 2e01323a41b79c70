"""Model parallelism beside ZeRO, torchtitan-style: the (data..., model...) device mesh (mesh.py) and DeepSpeed's
AutoTP as DTensor tensor parallelism (tensor_parallel.py: the plan from the model's tp_plan or DeepSpeed's
preset_model / partition_config, applied with parallelize_module before FSDP2 shards over the data dimensions), and
DeepSpeed's Ulysses sequence parallelism (ulysses.py: all-to-all attention over heads, the sequence-sharding data
adapter and the whole-sequence loss; its groups are process groups inside the data dimension, not a mesh one)."""
from fsdpzero.parallel.mesh import (MODEL_DIMS, build_parallel_mesh, check_user_mesh, data_dims, data_mesh,
                                    data_rank_and_size, mesh_size, model_mesh)

__all__ = ["MODEL_DIMS", "build_parallel_mesh", "check_user_mesh", "data_dims", "data_mesh", "data_rank_and_size",
           "mesh_size", "model_mesh"]
