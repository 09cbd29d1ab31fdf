"""The proof that a split is exact: ``parallelize`` keeps a split only once the parallel model has
given the whole model's numbers on a probe batch.

Recognition is by names and sizes (layouts/), and a forward can read the same weights another way:
a head-minor view of q/k/v, a log-softmax over the vocabulary, an operation across heads. So before
the split the whole model runs a small probe batch, in eval mode (its outputs) and in training mode
with dropout off (its outputs and, through a fixed random weighting of them, a sketch of every
parameter's gradient); after the split the parallel model runs the same. The sketch of a gradient
``g`` is ``(<g, R>, |g|^2)`` with ``R`` a product of one random vector per dimension drawn from the
parameter's name: no whole gradient is kept (each is reduced as soon as it is accumulated), R is
never formed (<g, R> is a chain of matrix-vector products), and a shard's part uses its slice of the
split dimension's vector, summed over the group.

What "the same" means is a relative error (the Frobenius norm of the difference over that of the
whole value) below a bound for the dtype: 1e-6 for float64, 1e-3 for float32, 5e-2 for bfloat16 and
float16. Rounding stays far below these (summing in another order, and the float32 norms some
float64 models compute); every wrong split measured is far above (0.14 to 0.96).

A mismatch raises ``ParallelizeProofError`` on every rank of the group, naming where it shows first:
the first split module, in forward order, whose output differs (an attention, an MLP, the embedding)
or in which the parallel model raised where the whole one ran (raised()), else the vocabulary path
(the LM head and whatever the model's own forward does with its logits), else the parameters whose
gradients differ; with the layout tried and the plan that leaves the module whole instead. The model
is then partly split and must be built again.
"""
import contextlib
import inspect
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...distributed import collectives
from ...distributed import state

#: Relative (Frobenius) error bound per parameter dtype (module docstring).
BOUNDS = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}
_BATCH, _SEQUENCE = 2, 8


class ParallelizeProofError(RuntimeError):
    """The parallel model did not give the whole model's numbers on the probe batch. ``failures``:
    compare()'s list, so that a proof run on a miniature (miniature.py) can be explained in terms of the
    model it stands for."""

    def __init__(self, message: str, failures=(), dtype: Optional[torch.dtype] = None, bound: float = 0.0):
        super().__init__(message)
        self.failures, self.dtype, self.bound = list(failures), dtype, bound


def bound_for(model: nn.Module) -> Tuple[torch.dtype, float]:
    """(the dtype the proof computes in, its bound): a bfloat16 or float16 model is proven in float32
    (_in_float32), since sums in another order round such gradients beyond any useful bound."""
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dtype = min(dtypes, key=lambda d: torch.finfo(d).bits) if dtypes else torch.float32
    if dtype in _NARROW:
        dtype = torch.float32
    return dtype, BOUNDS.get(dtype, 1e-3)


_NARROW = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def _in_float32(model: nn.Module):
    """bfloat16 and float16 parameters and buffers widened to float32 for the probe, and narrowed back
    after: both directions are exact, so the model comes back bitwise as it was. The probe then checks
    the split's structure at float32's rounding (bfloat16's would hide nothing smaller than 10%)."""
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.dtype in _NARROW]
    saved = [(t, t.dtype) for t in tensors]
    for t, _ in saved:
        t.data = t.data.to(torch.float32)
    try:
        yield bool(saved)
    finally:
        for t, dtype in saved:
            t.data = t.data.to(dtype)
            if t.grad is not None and t.grad.dtype != dtype:
                t.grad = t.grad.to(dtype)


def _widened(value):
    if isinstance(value, torch.Tensor):
        return value.to(torch.float32) if value.dtype in _NARROW else value
    if isinstance(value, (tuple, list)):
        return type(value)(_widened(v) for v in value)
    if isinstance(value, dict):
        return {k: _widened(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------- the probe batch

def _first_parameter_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _token_ids(vocab: int, sequence: int, device) -> torch.Tensor:
    low = 3 if vocab > 8 else 0  # clear of the usual pad / bos / eos ids
    return torch.randint(low, vocab, (_BATCH, sequence), generator=_generator()).to(device)


def probe_inputs(model: nn.Module) -> Optional[Tuple[tuple, dict]]:
    """(args, kwargs) of a small probe batch for ``model``, or None when its inputs cannot be told
    (pass ``probe=`` to parallelize then)."""
    device = _first_parameter_device(model)
    config = getattr(model, "config", None)
    parameters = list(inspect.signature(model.forward).parameters)
    if config is not None and getattr(config, "vocab_size", None) and "input_ids" in parameters:
        limit = [getattr(config, k, None) for k in ("max_position_embeddings", "n_positions", "max_length")]
        limit = [n for n in limit if isinstance(n, int) and n > 0]
        sequence = min([_SEQUENCE] + limit)
        kwargs = {"input_ids": _token_ids(config.vocab_size, sequence, device)}
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in parameters:
            kwargs["decoder_input_ids"] = _token_ids(config.vocab_size, sequence, device)
        if "use_cache" in parameters:
            kwargs["use_cache"] = False
        return (), kwargs
    size = _image_size(model)
    if size is not None:
        channels, height, width = size
        image = torch.randn(_BATCH, channels, height, width, generator=_generator())
        return (image.to(device, _float_dtype(model)),), {}
    first = next((m for m in model.modules() if isinstance(m, (nn.Embedding, nn.Linear))), None)
    if isinstance(first, nn.Embedding):
        return (_token_ids(first.num_embeddings, _SEQUENCE, device),), {}
    if isinstance(first, nn.Linear):
        x = torch.randn(_BATCH, _SEQUENCE, first.in_features, generator=_generator())
        return (x.to(device, _float_dtype(model)),), {}
    return None


def with_labels(model: nn.Module, inputs: Tuple[tuple, dict]) -> Optional[Tuple[tuple, dict]]:
    """The token-id probe with ``labels`` (the ids themselves) for a model whose forward takes them, so
    that the loss its own forward computes from the logits is proven too; None otherwise."""
    args, kwargs = inputs
    ids = kwargs.get("decoder_input_ids", kwargs.get("input_ids"))
    if ids is None or "labels" in kwargs or "labels" not in inspect.signature(model.forward).parameters:
        return None
    return args, dict(kwargs, labels=ids)


def _float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _image_size(model: nn.Module) -> Optional[Tuple[int, int, int]]:
    """(channels, height, width) of a vision model's input (timm, torchvision), or None."""
    for cfg_name in ("pretrained_cfg", "default_cfg"):
        cfg = getattr(model, cfg_name, None)
        if isinstance(cfg, dict) and isinstance(cfg.get("input_size"), (tuple, list)) and len(cfg["input_size"]) == 3:
            embed = getattr(model, "patch_embed", None)
            img = getattr(embed, "img_size", None)
            channels = int(cfg["input_size"][0])
            if isinstance(img, (tuple, list)) and len(img) == 2:
                return channels, int(img[0]), int(img[1])
            return tuple(int(n) for n in cfg["input_size"])
    embed = getattr(model, "patch_embed", None)
    img = getattr(embed, "img_size", None)
    proj = getattr(embed, "proj", None)
    if isinstance(img, (tuple, list)) and len(img) == 2 and isinstance(proj, nn.Conv2d):
        return proj.in_channels, int(img[0]), int(img[1])
    image_size = getattr(model, "image_size", None)  # torchvision's VisionTransformer
    conv = getattr(model, "conv_proj", None)
    if isinstance(image_size, int) and isinstance(conv, nn.Conv2d):
        return conv.in_channels, image_size, image_size
    return None


# ----------------------------------------------------------------------------- one run

def _floating_outputs(output) -> List[torch.Tensor]:
    """The floating tensors of a model's output (tensor, tuple, dict or ModelOutput), in order;
    caches and integer tensors left out."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, dict) or hasattr(output, "to_tuple"):
        values = [v for k, v in output.items() if "past_key_values" not in str(k)]
    elif isinstance(output, (tuple, list)):
        values = list(output)
    else:
        return []
    found = []
    for value in values:
        if isinstance(value, (torch.Tensor, tuple, list, dict)):
            found.extend(_floating_outputs(value))
    return found


def _first_floating(output) -> Optional[torch.Tensor]:
    found = _floating_outputs(output)
    return found[0] if found else None


@contextlib.contextmanager
def _dropout_off(model: nn.Module):
    """Training mode without dropout: nn.Dropout modules at p=0 and float attributes named *dropout*
    (what attention implementations read) or *drop_prob* (timm's stochastic depth) at 0.0, restored
    after."""
    saved = []
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            saved.append((module, "p", module.p))
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if ("dropout" in key or "drop_prob" in key) and isinstance(value, float):
                saved.append((module, key, value))
                setattr(module, key, 0.0)
    try:
        yield
    finally:
        for module, key, value in reversed(saved):
            setattr(module, key, value)


@contextlib.contextmanager
def _mode(model: nn.Module, training: bool):
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def _weights_for(outputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """A fixed random weighting of every output (the same on every rank and in both runs)."""
    g = _generator(1)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype) for o in outputs]


def _factors(name: str, shape, device) -> List[torch.Tensor]:
    """R of a parameter, as one float64 vector per dimension: R[i, j, ...] = u0[i] * u1[j] * ... with
    unit-variance entries drawn from the parameter's name, so that both runs and every rank draw the
    same, and R is never formed (<g, R> is a chain of matrix-vector products)."""
    g = _generator(zlib.crc32(name.encode()))
    return [torch.randn(n, generator=g, dtype=torch.float64).to(device) for n in shape]


#: Elements of a gradient taken to float64 at a time by _sketch.
_SKETCH_BLOCK = 1 << 20


def _sketch(grad: torch.Tensor, factors: List[torch.Tensor]) -> torch.Tensor:
    """float64 [<grad, R>, |grad|^2] (R from ``factors``), summed in float64 over blocks of rows taken to
    float64 one at a time: in float32, <grad, R> of a large gradient (a 50,257-row vocabulary) is a sum
    of terms whose magnitudes add up to thousands of times |grad|, and its rounding alone reached the
    float32 bound; no float64 copy of the whole gradient is made."""
    if grad.dim() == 0:  # R is the scalar 1
        value = grad.to(torch.float64)
        return torch.stack([value, value * value]).cpu()
    rows = grad.shape[0]
    per_row = max(1, grad[0].numel())
    step = max(1, _SKETCH_BLOCK // per_row)
    dot = torch.zeros((), dtype=torch.float64, device=grad.device)
    square = torch.zeros((), dtype=torch.float64, device=grad.device)
    for start in range(0, rows, step):
        block = grad[start:start + step].to(torch.float64)
        contracted = block
        for u in reversed(factors[1:]):  # each product contracts the last dimension
            contracted = contracted @ u
        dot += contracted @ factors[0][start:start + step]
        square += block.square().sum()
    return torch.stack([dot, square]).cpu()


def _shard_of(vector: torch.Tensor, layout) -> torch.Tensor:
    """This rank's pieces of a factor along the split dimension, in the order its shard stores them."""
    pieces = [vector[offset:offset + length] for offset, length in layout.pieces_of(layout.group_rank)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class Record:
    """What one run saw: outputs (eval and train), watched modules' first outputs, gradient sketches."""

    def __init__(self):
        self.eval_outputs: List[torch.Tensor] = []
        self.train_outputs: List[torch.Tensor] = []
        self.module_outputs: Dict[str, torch.Tensor] = {}
        self.module_order: List[str] = []
        self.sketches: Dict[str, torch.Tensor] = {}  # name -> float64 [<g, R>, |g|^2]
        self.entered: List[str] = []  # watched modules in the order their forwards began


def _watch(modules: Dict[str, nn.Module], record: Record):
    handles = []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(lambda mod, args, name=name: record.entered.append(name)))
        def hook(mod, args, output, name=name):
            if name not in record.module_outputs:
                value = _first_floating(output)
                if value is not None:
                    record.module_outputs[name] = value.detach().clone()
                    record.module_order.append(name)
        handles.append(module.register_forward_hook(hook))
    return handles


def run_probe(model: nn.Module, inputs: Tuple[tuple, dict], watched: Dict[str, nn.Module],
              sketch: Callable[[nn.Module, Record], Callable[[], None]],
              output_context=contextlib.nullcontext, record: Optional[Record] = None) -> Record:
    """Runs the probe batch through ``model`` (eval, then train with dropout off and a backward),
    without touching the caller's RNG streams or gradients. ``sketch(model, record)`` arms the
    gradient sketches and returns what finishes them after the backward. ``record``: the Record to
    fill (the caller keeps what it saw before an exception), else a new one."""
    record = Record() if record is None else record
    saved_grads = {id(p): p.grad for p in model.parameters()}
    for p in model.parameters():
        p.grad = None
    devices = sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), output_context(), _in_float32(model) as widened:
            args, kwargs = _widened(inputs) if widened else inputs
            handles = _watch(watched, record)
            try:
                with _mode(model, False), torch.no_grad():
                    record.eval_outputs = [o.detach().clone() for o in _floating_outputs(model(*args, **kwargs))]
            finally:
                for h in handles:
                    h.remove()
            with _mode(model, True), _dropout_off(model):
                finish = sketch(model, record)
                outputs = _floating_outputs(model(*args, **kwargs))
                record.train_outputs = [o.detach().clone() for o in outputs]
                total = sum((o * w).sum() for o, w in zip(outputs, _weights_for(outputs)) if o.requires_grad)
                if isinstance(total, torch.Tensor) and total.requires_grad:
                    total.backward()
                finish()
    finally:
        for p in model.parameters():
            p.grad = saved_grads.get(id(p))
    return record


def _on_each_gradient(model: nn.Module, take: Callable[[str, torch.Tensor], None]) -> Callable[[], None]:
    """Calls ``take(name, gradient)`` as soon as each parameter's gradient is accumulated (after any hook
    on the gradient itself, such as the sums of partial gradients under sequence parallelism), then drops
    it: the gradients are never all held. Returns what removes the hooks."""
    handles = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue

        def hook(param, name=name):
            take(name, param.grad)
            param.grad = None
        handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove():
        for h in handles:
            h.remove()
    return remove


def whole_sketch(model: nn.Module, record: Record) -> Callable[[], None]:
    """Each parameter's sketch, from its whole gradient."""
    def take(name, g):
        record.sketches[name] = _sketch(g, _factors(name, g.shape, g.device))
    return _on_each_gradient(model, take)


def parallel_sketch(layouts: Dict[str, object], group: str) -> Callable[[nn.Module, Record], Callable[[], None]]:
    """The same sketches from the shards: a sharded parameter's part of <g, R> with its slice of R's factor
    along the split dimension and its part of |g|^2, summed over the group in one all-reduce after the
    backward."""
    def arm(model: nn.Module, record: Record) -> Callable[[], None]:
        sharded: Dict[str, torch.Tensor] = {}

        def take(name, g):
            layout = layouts.get(name)
            if layout is not None and layout.sharded:
                factors = _factors(name, layout.full_shape, g.device)
                factors[layout.dim] = _shard_of(factors[layout.dim], layout)
                sharded[name] = _sketch(g, factors)
            else:
                record.sketches[name] = _sketch(g, _factors(name, g.shape, g.device))
        remove = _on_each_gradient(model, take)

        def finish():
            remove()
            names = sorted(name for name, layout in layouts.items() if layout.sharded and name in
                           dict(model.named_parameters()))
            if not names:
                return
            packed = torch.stack([sharded.get(name, torch.zeros(2, dtype=torch.float64)) for name in names])
            if state.get_group_size(group) > 1:
                collectives.all_reduce(packed, group=state.get_group(group))
            for name, values in zip(names, packed):
                record.sketches[name] = values
        return finish
    return arm


# ----------------------------------------------------------------------------- the verdict

def relative_error(whole: torch.Tensor, parallel: torch.Tensor) -> float:
    if whole.shape != parallel.shape:
        return float("inf")
    a, b = whole.to(torch.float64).cpu(), parallel.to(torch.float64).cpu()
    scale = a.norm().item()
    diff = (a - b).norm().item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def _sketch_error(whole: torch.Tensor, parallel: torch.Tensor, floor: float) -> float:
    """From the two sketches: |<g-g', R>| estimates |g - g'| (R has unit-variance entries), and the
    norms compare directly; both relative to |g|, or to ``floor`` where |g| is below it (a gradient
    that is zero in exact arithmetic, a key bias's under softmax say, is rounding noise alone)."""
    norm = max(whole[1].clamp_min(0).sqrt().item(), floor)
    if norm == 0.0:
        return 0.0 if parallel[1].item() == 0.0 and parallel[0].item() == 0.0 else float("inf")
    projected = abs(whole[0].item() - parallel[0].item()) / norm
    norms = abs(whole[1].clamp_min(0).sqrt().item() - parallel[1].clamp_min(0).sqrt().item()) / norm
    return max(projected, norms)


#: A parameter's gradient error counts relative to at least this fraction of the whole gradient's norm.
GRADIENT_FLOOR = 1e-4


def compare(whole: Record, parallel: Record, bound: float) -> List[Tuple[str, str, float]]:
    """[(kind, where, error)] beyond ``bound``, the first place in forward order first."""
    found: List[Tuple[str, str, float]] = []
    for name in whole.module_order:
        if name in parallel.module_outputs:
            error = relative_error(whole.module_outputs[name], parallel.module_outputs[name])
            if error > bound:
                found.append(("module", name, error))
                break
    for kind, a, b in (("eval", whole.eval_outputs, parallel.eval_outputs),
                       ("train", whole.train_outputs, parallel.train_outputs)):
        if len(a) != len(b):
            found.append((kind, "the number of outputs", float("inf")))
            continue
        for index, (x, y) in enumerate(zip(a, b)):
            error = relative_error(x, y)
            if error > bound:
                found.append((kind, f"output {index}", error))
    total = sum(max(sketch[1].item(), 0.0) for sketch in whole.sketches.values()) ** 0.5
    for name, sketch in whole.sketches.items():
        other = parallel.sketches.get(name)
        error = float("inf") if other is None else _sketch_error(sketch, other, GRADIENT_FLOOR * total)
        if error > bound:
            found.append(("gradient", name, error))
    return found


def agree_before_split(record: Optional[Record], group: str) -> None:
    """One all-gather of (proving, a digest of the whole model's outputs) over the group; raises on every
    rank where they differ: a rank that proves while another does not would wait for it in a collective,
    and ranks whose whole models differ split weights that are not one model's. (``verify`` itself is
    checked with parallelize's other options, options_agree.py.)"""
    size = state.get_group_size(group)
    if size == 1:
        return
    digest = 0.0
    if record is not None:
        digest = sum(o.to(torch.float64).pow(2).sum().item() for o in record.eval_outputs)
    mine = torch.tensor([float(record is not None), digest], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(size)]
    collectives.all_gather(everyone, mine, group=state.get_group(group))
    proving = [bool(t[0].item()) for t in everyone]
    if len(set(proving)) > 1:
        raise ValueError(f"parallelize: the ranks of group {group!r} disagree about proving the split (by group "
                         f"rank: {proving}): pass the same probe= on every rank")
    if record is not None:
        refuse_different_models(group, [t[1].item() for t in everyone],
                                "their whole models give different outputs on the probe batch",
                                "sums of squares by group rank")


def refuse_different_models(group: str, values: List[float], differ: str, measure: str, floor: float = 0.0) -> None:
    """Raises on every rank (each passes the same ``values``, one per group rank) where the ranks' values
    differ by more than 1e-9 of the largest (or of ``floor``): ranks whose models differ would split
    weights that are not one model's."""
    if max(values) - min(values) > 1e-9 * max(floor, max(abs(v) for v in values)):
        raise ValueError(f"parallelize: the ranks of group {group!r} hold different models: {differ} ({measure}: "
                         f"{['%.6g' % v for v in values]}). Build the model under the same seed "
                         f"(torch.manual_seed) or load the same checkpoint on every rank.")


def agree_on_error(error: float, group: str) -> float:
    """The largest error over the group's ranks (so that every rank raises, or none)."""
    if state.get_group_size(group) == 1:
        return error
    value = torch.tensor([min(error, 1e300)], dtype=torch.float64)
    collectives.all_reduce(value, op="max", group=state.get_group(group))
    return value.item()


def _owner(name: str, placements) -> Optional[object]:
    """The placement whose module holds the parameter or module ``name``."""
    best = None
    for placement in placements:
        if name == placement.name or name.startswith(placement.name + "."):
            if best is None or len(placement.name) > len(best.name):
                best = placement
    return best


def _tried(placement) -> str:
    variant = getattr(placement.fit, "variant", None)
    return f"{placement.style} ({variant})" if variant else placement.style


def raised(error: Exception, record: Optional[Record] = None) -> List[Tuple[str, str, float]]:
    """compare()'s list for a parallel model that raised on the probe batch the whole model ran, with
    ("raised in", module) where a watched split module was running then (the innermost: begun last, not
    ended; an embedding subclass indexing its own table past its shard)."""
    found = [("raised", f"{type(error).__name__}: {error}", float("inf"))]
    running = [name for name in (record.entered if record else []) if name not in record.module_outputs]
    return found + ([("raised in", running[-1], float("inf"))] if running else [])


def _of_its_kind(placement, placements, where: str) -> List[str]:
    """Every split module of ``placement``'s style and class: they read their weights the same way, so all
    of them stay whole."""
    return [p.name for p in placements if p.style == placement.style
            and type(p.module) is type(placement.module)] or [where]


def _what_to_do(replicate: List[str], split: bool, most: Optional[int] = None) -> str:
    """The refusal's last sentence: the plan that leaves ``replicate`` whole (at most ``most`` named), or
    verify=False."""
    state_now = "The model is now partly split and cannot be used: " if split else "Nothing is split: "
    if not replicate:
        return f"{state_now}build the model again, or pass verify=False to skip this proof (at the risk of a " \
               f"silently wrong model)."
    named = replicate if most is None else replicate[:most]
    return (state_now + ("build the model again and " if split else "") + "pass plan= with "
            + ", ".join(f"{n!r}: 'replicate'" for n in named) + (" ..." if len(named) < len(replicate) else "")
            + " (ts.nn.auto_plan(model) gives the plan to edit), or pass verify=False to skip this proof (at the "
              "risk of a silently wrong model).")


def _explain_raised(what: str, placements, split: bool, where: Optional[str] = None) -> str:
    placement = _owner(where, placements) if where is not None else None
    if placement is not None:
        replicate = _of_its_kind(placement, placements, where)
        what = f"in {where!r} ({_tried(placement)}): {what}"
    else:
        projections = [p.name for p in placements if p.style in ("column", "row")]
        replicate = projections or [p.name for p in placements if p.style != "vocab"]
    return (f"parallelize: the split model raises on the probe batch that the whole model runs ({what}): its "
            f"forward does not compute from the shards it is given (a head count read from an attribute, say). "
            + _what_to_do(replicate, split, most=8))


def explain(failures: List[Tuple[str, str, float]], placements, dtype: torch.dtype, bound: float,
            sequence_parallel: bool, split: bool = True) -> str:
    """The error message: where the numbers differ first, what was tried, what to pass instead (``split``:
    whether ``placements``' model was split already, or only its miniature was)."""
    if not failures:  # this rank's numbers agree; another rank's did not (each rank's error names its own)
        return (f"parallelize: the split is not exact on another rank of the group (this rank's outputs and "
                f"gradients agree within {bound:g}): see that rank's error for the module at fault")
    kind, where, error = failures[0]
    if kind == "raised":
        return _explain_raised(where, placements, split, next((w for k, w, _ in failures if k == "raised in"), None))
    replicate: List[str] = []
    if kind == "module":
        placement = _owner(where, placements)
        what = (f"the split of {where!r} ({_tried(placement)}) gives another output than the whole module on the "
                f"probe batch (relative error {error:.3g})")
        replicate = _of_its_kind(placement, placements, where)
    elif kind in ("eval", "train"):
        vocab = [p.name for p in placements if p.style == "vocab"]
        what = (f"the model's {where} ({'eval' if kind == 'eval' else 'training'} mode) differs from the whole "
                f"model's (relative error {error:.3g}) while every split block agrees: the vocabulary path (the "
                f"vocabulary-parallel embedding and LM head {vocab}, and whatever the model's own forward does with "
                f"the logits, a softmax over the vocabulary say) cannot be split this way")
        replicate = vocab
    else:
        names = [w for k, w, _ in failures if k == "gradient"][:4]
        owners = []
        for name in names:
            placement = _owner(name, placements)
            if placement is not None and placement.name not in owners:
                owners.append(placement.name)
        what = (f"the gradients of {names} differ from the whole model's (relative error {error:.3g}) while the "
                f"outputs agree")
        if sequence_parallel:
            what += " (under sequence_parallel=True: parameters whose partial gradients are not summed?)"
        replicate = owners
    return (f"parallelize: the split is not exact: {what}; the bound for {str(dtype).replace('torch.', '')} is "
            f"{bound:g}. " + _what_to_do(replicate, split))
