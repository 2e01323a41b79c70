"""The engine's gradient path for `offload_optimizer.device: nvme`: fsdpzero.offload_path's OffloadGradPath with
fsdpzero.nvme.NVMeAdam as the optimizer (and, with `offload_param: nvme`, each FSDP unit swapped in by
fsdpzero.nvme_params.ParamSwapper while NVMeAdam steps it). Built by fsdpzero.offload.build_grad_path."""
from __future__ import annotations

import torch

from fsdpzero.offload_chunks import _like, _local, _on
from fsdpzero.offload_path import OffloadGradPath


class NVMeGradPath(OffloadGradPath):
    """fsdpzero.offload's gradient path with NVMeAdam as the optimizer: gradients land where they do for
    `offload_optimizer: cpu` (pinned buffers, or the CPU shards), one NVMeAdam.step() swaps the states through
    per sub-group, then the updated shards go back. Checkpoints have the cpu path's layout, so a run can resume
    from one into the other."""

    def _step_chunks(self, work, factor) -> None:
        swapper = self.param_swapper   # offload_param nvme: each unit is swapped in when its first slice steps
        self.optimizer.before_update = None if swapper is None else (
            lambda p: swapper.step_touch(swapper.index[id(self._unit_of[id(p)])]))
        grads = {}
        for chunk, items in work:
            if chunk.d2h_done is not None:
                chunk.d2h_done.synchronize()
            if chunk.h2d_done is not None:       # last step's H2D must have read the buffers we overwrite
                chunk.h2d_done.synchronize()
            grads.update({id(e.master): grad for e, grad in items})
        self.optimizer.step(grad_scale=factor, grads=grads)
        for chunk, items in work:
            with _on(self.h2d):
                for e, _ in items:
                    if not _same_storage(e.master, _local(e.param)):
                        _local(e.param).copy_(e.master, non_blocking=self.h2d is not None)
                if self.h2d is not None and items:
                    chunk.h2d_done = torch.cuda.Event()
                    chunk.h2d_done.record(self.h2d)
            chunk.ready.set()
        if swapper is not None:
            swapper.step_end()

    @torch.no_grad()
    def refresh_masters(self) -> None:
        super().refresh_masters()              # stand-ins <- the model's shards
        self.optimizer.write_masters()         # and on to the fp32 masters on disk

    def _order(self):
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        by_stand_in = {id(e.master): e for e in self.entries}
        return params, [by_stand_in[id(p)] for p in params]

    def state_dict(self) -> dict:
        self._join()
        self._params_resident()
        saved = self.optimizer.state_dict()              # read back from disk, fp32
        params, entries = self._order()
        state = {}
        for i, (p, e) in enumerate(zip(params, entries)):
            st = saved["state"].get(i, {})
            tensors = {k: st[k] for k in ("exp_avg", "exp_avg_sq") if k in st}
            tensors["master"] = st.get("master", p)     # an fp32 stand-in is its own master
            state[e.name] = {"step": st.get("step", torch.tensor(0.0)),
                             **{k: _like(e.param, v) for k, v in tensors.items()}}
        groups, at = [], 0
        for g in self.optimizer.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [e.name for e in entries[at:at + len(g["params"])]]})
            at += len(g["params"])
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        self._join()
        self._params_resident(dirty=True)
        params, entries = self._order()
        state = {}
        for i, (p, e) in enumerate(zip(params, entries)):
            saved = sd["state"].get(e.name)
            if saved is None:
                continue
            # no "master" (a non-offload checkpoint): the model weights just loaded are the masters
            master = _local(saved["master"] if "master" in saved else e.param).float().reshape(p.shape)
            state[i] = {"step": saved["step"].clone(), "exp_avg": _local(saved["exp_avg"]).reshape(p.shape),
                        "exp_avg_sq": _local(saved["exp_avg_sq"]).reshape(p.shape)}
            if p.dtype == torch.float32:
                p.copy_(master)
            else:
                state[i]["master"] = master
            _local(e.param).copy_(master.view(_local(e.param).shape))   # the device copy follows the master
        groups, at = [], 0
        for g, s in zip(self.optimizer.param_groups, sd["param_groups"]):
            groups.append({**{k: v for k, v in s.items() if k != "params"},
                           "params": list(range(at, at + len(g["params"])))})
            at += len(g["params"])
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def close(self) -> None:
        super().close()
        self.optimizer.close()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """offload_param nvme: the stand-in shares the shard's storage (swapped out, its data_ptr is 0)."""
    return a is b or a.untyped_storage()._cdata == b.untyped_storage()._cdata
