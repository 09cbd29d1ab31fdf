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
"""
from typing import Iterable, Optional, Tuple

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

    def _rows_and_grad(self, p: torch.Tensor):
        """(row indices or None for all, gradient rows [n, rest])."""
        grad = p.grad
        if not grad.is_sparse:
            return None, _as_rows(grad)
        if grad.sparse_dim() != 1:
            raise ValueError(f"{type(self).__name__}: a sparse gradient must be row-sparse (sparse_dim 1), "
                             f"got sparse_dim {grad.sparse_dim()}")
        grad = grad.coalesce()
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

    @staticmethod
    def _take(t: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
        return t if rows is None else t.index_select(0, rows)

    @staticmethod
    def _put(t: torch.Tensor, rows: Optional[torch.Tensor], values: torch.Tensor) -> None:
        if rows is None:
            if values.data_ptr() != t.data_ptr():
                t.copy_(values)
        else:
            t.index_copy_(0, rows, values)

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
                self._update(group, _as_rows(p), rows, grad, state)
        return loss


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

    def _update(self, group, param_rows, rows, grad, state):
        p = self._take(param_rows, rows)
        d_p = grad if group["weight_decay"] == 0 else grad.add(p, alpha=group["weight_decay"])
        momentum = group["momentum"]
        if momentum != 0:
            buffer_rows = _as_rows(state["momentum_buffer"])
            buf = self._take(buffer_rows, rows).mul(momentum).add_(d_p, alpha=1 - group["dampening"])
            if "row_step" in state:
                # A row's first step starts its buffer at d_p, as torch's does.
                steps = self._take(state["row_step"], rows)
                buf = torch.where((steps == 0).unsqueeze(1), d_p, buf)
                self._put(state["row_step"], rows, steps + 1)
            self._put(buffer_rows, rows, buf)
            d_p = d_p.add(buf, alpha=momentum) if group["nesterov"] else buf
        self._put(param_rows, rows, p.add(d_p, alpha=-group["lr"]))


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

    def _update(self, group, param_rows, rows, grad, state):
        beta1, beta2 = group["betas"]
        p = self._take(param_rows, rows)
        if group["weight_decay"] != 0:
            grad = grad.add(p, alpha=group["weight_decay"])
        steps = self._take(state["row_step"], rows) + 1
        avg_rows, sq_rows = _as_rows(state["exp_avg"]), _as_rows(state["exp_avg_sq"])
        exp_avg = self._take(avg_rows, rows).lerp(grad, 1 - beta1)
        exp_avg_sq = self._take(sq_rows, rows).mul(beta2).addcmul(grad, grad, value=1 - beta2)
        step = steps.to(torch.float64).unsqueeze(1)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
        step_size = (group["lr"] / bias_correction1).to(p.dtype)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt.to(p.dtype)).add_(group["eps"])
        self._put(avg_rows, rows, exp_avg)
        self._put(sq_rows, rows, exp_avg_sq)
        self._put(param_rows, rows, p - step_size * exp_avg / denom)
        self._put(state["row_step"], rows, steps)
