"""SGD (with momentum) and Adam where a row-sparse gradient updates only its rows.

A sampled ParallelMarginLoss gives its weight a sparse COO gradient holding the
kept classes' rows (sparse_dim 1, like torch.nn.Embedding(sparse=True)). The
rows it does not hold were not part of the loss: with torch.optim.SGD's
momentum or Adam they would still move (the momentum keeps pushing) and their
state would decay. Here they do not: each row has its own step count
(``state["row_step"]``, int64 [rows]; SGD without dampening needs none) and only the rows of the gradient update
their value, their momentum / moments and their step, by exactly the formulas
of torch.optim.SGD and torch.optim.Adam (their single-tensor forms) as if each
row were a parameter of its own that got a gradient at those steps only.
Dense gradients update every row: then the result is torch's optimizer's.

Cost (benchmarks/optimizer.py): a dense gradient takes torch's own sequence of
in-place passes over the parameter and its state (the same temporaries as
torch.optim.SGD / Adam). A row-sparse gradient of n rows touches only those
rows: RowSparseSGD (without dampening) and RowSparseAdam update them, their
state and their steps in place in one pass on CPU (the ops
shard::_row_sparse_sgd_ / shard::_row_sparse_adam_; other devices gather the
rows, update and write them back, with no host synchronisation). What those ops
do not take (SGD with dampening, DTensor parameters, a tensor lr) gathers the
rows with index_select, updates them and writes them back with index_copy_ /
index_add_, in [n, row] buffers the optimizer keeps between steps
(``scratch_bytes``: at most three, sized by the largest n seen), because a
fresh buffer of that size costs more in page faults on CPU than the arithmetic
done in it.
"""
from typing import Iterable, List, Optional, Tuple

import torch


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[rows, rest] view of a parameter or state tensor (a 0-d or 1-D one is
    one row per element, so each element keeps its own step)."""
    if t.dim() == 0:
        return t.view(1, 1)
    return t.view(t.shape[0], -1)


class _RowSparseOptimizer(torch.optim.Optimizer):
    _state_names: Tuple[str, ...] = ()
    #: State with one value per parameter row, [rows] (checkpoints split it like the rows).
    row_state_keys: Tuple[str, ...] = ("row_step",)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, except that ``row_step`` stays int64:
        torch casts every state tensor but ``step`` to a floating parameter's
        dtype, and a count in bfloat16 would lose steps past 256."""
        steps, state = {}, {}
        for index, values in state_dict["state"].items():
            if "row_step" in values:
                steps[index] = values["row_step"]
            state[index] = {k: v for k, v in values.items() if k != "row_step"}
        super().load_state_dict({**state_dict, "state": state})
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for index, p in zip(saved_ids, params):
            if index in steps:
                loaded = self.state[p]
                # row_step first, as _state_of builds it.
                self.state[p] = {"row_step": steps[index].to(device=p.device, dtype=torch.int64), **loaded}

    @property
    def scratch_bytes(self) -> int:
        """Bytes held between steps for row-sparse updates (not part of the state)."""
        return sum(t.numel() * t.element_size() for t in getattr(self, "_scratch", {}).values())

    def _scratch_rows(self, like: torch.Tensor, count: int) -> List[torch.Tensor]:
        """`count` distinct [n, rest] buffers shaped and typed like `like`, carved
        from one buffer per (device, dtype) that only grows."""
        scratch = self.__dict__.setdefault("_scratch", {})
        key = (like.device, like.dtype)
        need = count * like.numel()
        if key not in scratch or scratch[key].numel() < need:
            scratch.pop(key, None)  # free the old buffer before taking the new one
            scratch[key] = torch.empty(need, dtype=like.dtype, device=like.device)
        flat = scratch[key]
        return [flat[i * like.numel():(i + 1) * like.numel()].view_as(like) for i in range(count)]

    def _rows_and_grad(self, p: torch.Tensor):
        """(row indices or None for all, gradient rows [n, rest])."""
        grad = p.grad
        if not grad.is_sparse:
            return None, _as_rows(grad)
        if grad.sparse_dim() != 1:
            raise ValueError(f"{type(self).__name__}: a sparse gradient must be row-sparse (sparse_dim 1), "
                             f"got sparse_dim {grad.sparse_dim()}")
        if not grad.is_coalesced() and grad.device.type == "cpu":
            # autograd's accumulation re-wraps a sparse gradient and drops its coalesced mark (the
            # margin loss's is built coalesced); strictly increasing rows are coalesced: one pass
            # over the indices instead of coalesce's sort and copy of the values.
            rows = grad._indices()[0]
            if rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all()):
                return rows, grad._values().reshape(rows.numel(), -1)
        grad = grad.coalesce()  # free where already marked coalesced
        return grad.indices()[0], grad.values().reshape(grad.indices().shape[1], -1)

    def _needs_row_steps(self, group) -> bool:
        return True

    def _state_of(self, p: torch.Tensor, group) -> dict:
        state = self.state[p]
        if not state:
            if self._needs_row_steps(group):
                state["row_step"] = torch.zeros(_as_rows(p).shape[0], dtype=torch.int64, device=p.device)
            for name in self._state_names:
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows, grad = self._rows_and_grad(p)
                state = self._state_of(p, group)
                if rows is None:
                    self._update_dense(group, _as_rows(p), grad, state)
                elif rows.numel() > 0:
                    self._update_rows(group, _as_rows(p), rows, grad, state)
        return loss


def _uniform_step(row_step: torch.Tensor) -> Optional[int]:
    """The step every row shares, or None when they differ or when finding out
    would block the host (a CUDA tensor): then the per-row formulas run."""
    if row_step.device.type != "cpu" or row_step.numel() == 0:
        return None
    low, high = torch.aminmax(row_step)
    return int(low) if int(low) == int(high) else None


# Where torch has fused SGD and Adam kernels (torch.optim.SGD / Adam(fused=True)'s).
_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _torch_fuses(param: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether torch's fused kernels take these plain tensors: not a tensor subclass such as the
    DTensor parameters of fully_shard (FSDP2), which has no sharding rule for them; those take the
    ATen passes."""
    return (type(param) in (torch.Tensor, torch.nn.Parameter) and type(grad) is torch.Tensor
            and param.device.type in _FUSED_DEVICES and param.dtype in _FUSED_DTYPES and param.is_contiguous()
            and grad.is_contiguous())


class RowSparseSGD(_RowSparseOptimizer):
    """torch.optim.SGD(params, lr, momentum, dampening, weight_decay, nesterov)
    per row: rows a row-sparse gradient does not hold are left alone, momentum
    included. State: ``momentum_buffer`` (like the parameter); with dampening
    also ``row_step`` (a row's first step starts its buffer at d_p)."""

    _state_names = ("momentum_buffer",)

    def _needs_row_steps(self, group) -> bool:
        # Without dampening a zero buffer's first step is torch's (buf = d_p):
        # the state is then just momentum_buffer, which checkpoints collect.
        return group["momentum"] != 0 and group["dampening"] != 0

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        if lr < 0.0 or momentum < 0.0 or weight_decay < 0.0:
            raise ValueError(f"RowSparseSGD: lr, momentum and weight_decay must be >= 0, got lr={lr}, "
                             f"momentum={momentum}, weight_decay={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("RowSparseSGD: nesterov needs a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    @staticmethod
    def _fuses(group, param, grad, state) -> bool:
        """Whether torch's fused SGD kernel can take this update: not with per-row step counts
        (dampening: a row's first step starts its buffer), nor where torch has no such kernel."""
        return "row_step" not in state and _torch_fuses(param, grad)

    @staticmethod
    def _fused_update(group, param, grad, buf) -> None:
        """torch's fused SGD kernel on ``param`` rows: one pass over the parameter, its gradient and
        momentum instead of torch.optim.SGD(foreach)'s four, the same arithmetic (bitwise its result,
        tests/unit/test_row_sparse_optim.py); the gradient is not written."""
        torch._fused_sgd_([param], [grad], [buf] if group["momentum"] != 0 else [],
                          weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                          dampening=group["dampening"], nesterov=group["nesterov"], maximize=False,
                          is_first_step=False)

    def _update_dense(self, group, param, grad, state):
        if self._fuses(group, param, grad, state):
            buf = _as_rows(state["momentum_buffer"]) if group["momentum"] != 0 else None
            return self._fused_update(group, param, grad, buf)
        # torch.optim.SGD's passes, in its order (so the result is its result bitwise).
        weight_decay, momentum = group["weight_decay"], group["momentum"]
        d_p = grad if weight_decay == 0 else grad.add(param, alpha=weight_decay)
        if momentum != 0:
            buf = _as_rows(state["momentum_buffer"])
            buf.mul_(momentum).add_(d_p, alpha=1 - group["dampening"])
            if "row_step" in state:
                self._start_buffers(buf, d_p, state["row_step"])
                state["row_step"].add_(1)
            if group["nesterov"]:
                d_p = d_p.add_(buf, alpha=momentum) if d_p is not grad else d_p.add(buf, alpha=momentum)
            else:
                d_p = buf
        param.add_(d_p, alpha=-group["lr"])

    @staticmethod
    def _start_buffers(buf: torch.Tensor, d_p: torch.Tensor, steps: torch.Tensor) -> None:
        """A row's first step starts its buffer at d_p, as torch's does (with
        dampening, buf * momentum + (1 - dampening) * d_p would not)."""
        first = steps == 0
        if steps.device.type == "cpu" and not bool(first.any()):
            return  # the usual case on CPU: one pass over the step counts, none over the buffer
        torch.where(first.unsqueeze(1), d_p, buf, out=buf)

    def _update_rows(self, group, param, rows, grad, state):
        weight_decay, momentum = group["weight_decay"], group["momentum"]
        if self._fuses(group, param, grad, state) and not torch.is_tensor(group["lr"]):
            # The kept rows updated in place in one pass (CPU; elsewhere gathered through torch's
            # fused kernel and written back): csrc/ops/row_sparse_sgd.h.
            buffer = _as_rows(state["momentum_buffer"]) if momentum != 0 else None
            torch.ops.shard._row_sparse_sgd_(param, buffer, rows, grad, group["lr"], momentum, weight_decay,
                                             group["nesterov"])
            return
        taken, buf = self._scratch_rows(grad, 2)
        if weight_decay != 0:
            d_p = torch.index_select(param, 0, rows, out=taken)
            torch.add(grad, d_p, alpha=weight_decay, out=d_p)
        else:
            d_p = grad
        if momentum != 0:
            buffer = _as_rows(state["momentum_buffer"])
            torch.index_select(buffer, 0, rows, out=buf)
            buf.mul_(momentum).add_(d_p, alpha=1 - group["dampening"])
            if "row_step" in state:
                steps = state["row_step"].index_select(0, rows)
                self._start_buffers(buf, d_p, steps)
                state["row_step"].index_copy_(0, rows, steps.add_(1))
            buffer.index_copy_(0, rows, buf)
            if group["nesterov"]:
                d_p = torch.add(d_p, buf, alpha=momentum, out=taken)
            else:
                d_p = buf
        # p + (-lr) * d_p per row: add_'s arithmetic, so the same bits as p.add_(d_p, alpha=-lr).
        param.index_add_(0, rows, d_p, alpha=-group["lr"])


class RowSparseAdam(_RowSparseOptimizer):
    """torch.optim.Adam(params, lr, betas, eps, weight_decay) per row: each row
    has its own step count for the bias corrections, and rows a row-sparse
    gradient does not hold keep their value, moments and step. State:
    ``exp_avg``, ``exp_avg_sq`` (like the parameter) and ``row_step``."""

    _state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"RowSparseAdam: need lr, eps, weight_decay >= 0 and betas in [0, 1), got lr={lr}, "
                             f"eps={eps}, weight_decay={weight_decay}, betas={betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @staticmethod
    def _row_factors(group, steps: torch.Tensor, dtype: torch.dtype):
        """(-step_size, sqrt(bias_correction2)) per row, [n, 1] in `dtype`, from
        each row's step (already advanced), computed in float64 like torch's
        Python floats."""
        beta1, beta2 = group["betas"]
        step = steps.to(torch.float64).unsqueeze(1)
        neg_step_size = (group["lr"] / (1 - torch.pow(beta1, step))) * -1
        bias_correction2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
        return neg_step_size.to(dtype), bias_correction2_sqrt.to(dtype)

    def _update_dense(self, group, param, grad, state):
        beta1, beta2 = group["betas"]
        steps = state["row_step"]
        shared = _uniform_step(steps)
        steps.add_(1)
        if shared is not None and _torch_fuses(param, grad):
            # Every row at the same step: torch's fused Adam kernel, one pass over the parameter, its
            # gradient and moments (torch.optim.Adam(fused=True)'s result bitwise, its step a
            # float32 tensor as there; the gradient is not written).
            step = torch.full((), shared + 1, dtype=torch.float32, device=param.device)
            torch._fused_adam_([param], [grad], [_as_rows(state["exp_avg"])], [_as_rows(state["exp_avg_sq"])], [],
                               [step], amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
                               weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            return
        if group["weight_decay"] != 0:
            grad = grad.add(param, alpha=group["weight_decay"])
        exp_avg, exp_avg_sq = _as_rows(state["exp_avg"]), _as_rows(state["exp_avg_sq"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        del grad
        denom = exp_avg_sq.sqrt()
        if shared is not None:
            # Every row at the same step: torch.optim.Adam's own passes and Python-float factors.
            step = shared + 1
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            denom.div_(bias_correction2_sqrt).add_(group["eps"])
            param.addcdiv_(exp_avg, denom, value=(group["lr"] / (1 - beta1**step)) * -1)
            return
        neg_step_size, bias_correction2_sqrt = self._row_factors(group, steps, param.dtype)
        denom.div_(bias_correction2_sqrt).add_(group["eps"])
        # addcdiv's (value * exp_avg) / denom with a value per row; + 1 * x adds x exactly.
        param.add_(torch.mul(exp_avg, neg_step_size).div_(denom))

    def _update_rows(self, group, param, rows, grad, state):
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = _as_rows(state["exp_avg"]), _as_rows(state["exp_avg_sq"])
        if _torch_fuses(param, grad) and not torch.is_tensor(group["lr"]):
            # The kept rows, their moments and steps updated in place in one pass (CPU; elsewhere
            # gathered, updated and written back): csrc/ops/row_sparse_adam.h.
            torch.ops.shard._row_sparse_adam_(param, exp_avg, exp_avg_sq, state["row_step"], rows, grad,
                                              group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
            return
        self._update_rows_in_passes(group, param, rows, grad, state)

    def _update_rows_in_passes(self, group, param, rows, grad, state):
        """The kept rows gathered into scratch, updated by torch.optim.Adam's passes with a step per
        row, written back: for what the op does not take (DTensor parameters, a tensor lr)."""
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = _as_rows(state["exp_avg"]), _as_rows(state["exp_avg_sq"])
        taken, avg, sq = self._scratch_rows(grad, 3)
        steps = state["row_step"].index_select(0, rows).add_(1)
        state["row_step"].index_copy_(0, rows, steps)
        if group["weight_decay"] != 0:
            torch.index_select(param, 0, rows, out=taken)
            grad = torch.add(grad, taken, alpha=group["weight_decay"], out=taken)
        torch.index_select(exp_avg, 0, rows, out=avg).lerp_(grad, 1 - beta1)
        exp_avg.index_copy_(0, rows, avg)
        torch.index_select(exp_avg_sq, 0, rows, out=sq).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        exp_avg_sq.index_copy_(0, rows, sq)
        neg_step_size, bias_correction2_sqrt = self._row_factors(group, steps, param.dtype)
        denom = sq.sqrt_().div_(bias_correction2_sqrt).add_(group["eps"])
        # p + (value * exp_avg) / denom, addcdiv's arithmetic with a value per row.
        param.index_add_(0, rows, avg.mul_(neg_step_size).div_(denom))
