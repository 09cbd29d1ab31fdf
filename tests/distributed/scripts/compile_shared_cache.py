"""torch.compile of a parallelized model with a compile cache that every rank shares (torch's default: one
TORCHINDUCTOR_CACHE_DIR), run twice in new processes by tests/distributed/test_compile_cache.py: the second run
loads what the first stored. GPT-2 with a vocabulary of 96, so that both ranks' embedding and loss graphs are the
same graph with the same shapes (only the vocabulary offset, which the ops read from the rank, differs). Each
rank compares the compiled model's loss, logits and gradients with the same model eager and with the unsharded
model, all in float64, and prints one JSON line."""
import json
import os
import sys

import torch
import torch._functorch.config

import shardtorch as ts
from tests.distributed import parallelize_models as models
from tests.distributed.cases_parallelize import _causal_reference_loss, collected_grads

ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]))
backend = sys.argv[1] if len(sys.argv) > 1 else "aot_eager"
# aot_eager stores its graphs in AOTAutograd's cache only when asked (inductor always does, but compiles slowly).
torch._functorch.config.force_autograd_cache = True
torch._functorch.config.bundled_autograd_cache = True
models.VOCAB = 96


def build():
    torch.manual_seed(0)
    return models.gpt2().to(torch.float64)


def relative(actual, expected):
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def run(model, ids, labels, reference=False):
    for p in model.parameters():
        p.grad = None
    if reference:  # Hugging Face's own loss upcasts the logits to float32: the float64 loss, written out
        logits = model(input_ids=ids).logits
        loss = _causal_reference_loss(logits, labels)
    else:
        out = model(input_ids=ids, labels=labels)
        loss, logits = out.loss, out.logits
    loss.backward()
    return loss.detach(), logits.detach()


reference, eager, model = build(), ts.nn.parallelize(build()), ts.nn.parallelize(build())
compiled = torch.compile(model, backend=backend)
generator = torch.Generator().manual_seed(3)
ids = torch.randint(0, models.VOCAB, (2, models.SEQ), generator=generator)
labels = ids.clone()
loss_r, logits_r = run(reference, ids, labels, reference=True)
grads_r = {k: p.grad for k, p in reference.named_parameters()}
loss_e, logits_e = run(eager, ids, labels)
grads_e = collected_grads(eager)
loss_c, logits_c = run(compiled, ids, labels)
grads_c = collected_grads(model)
counters = torch._dynamo.utils.counters
print(json.dumps({
    "rank": ts.distributed.get_rank(),
    "eager_vs_unsharded": max([relative(loss_e, loss_r), relative(logits_e, logits_r)]
                              + [relative(grads_e[k], g) for k, g in grads_r.items()]),
    "compiled_vs_eager": {"loss": relative(loss_c, loss_e), "logits": relative(logits_c, logits_e),
                          "gradients": max(relative(grads_c[k], grads_e[k]) for k in grads_r)},
    "aot_cache": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
}), flush=True)
