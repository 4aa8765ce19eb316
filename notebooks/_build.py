"""Writes the notebooks in this folder from the cell sources below.

    python notebooks/_build.py          # rewrite every *.ipynb (outputs empty)

Edit the cells here, not in the .ipynb files, and re-run: the committed
notebooks are always this script's output, so they carry no outputs, no
execution counts and no machine-specific metadata. `tests/test_notebooks.py`
executes each one headless on CPU (FOLDAX_NB_SMALL=1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

# Where Colab clones the project from: set FOLDAX_GIT_URL in the Colab
# environment to override.
GIT_URL = "https://github.com/foldax/foldax.git"

INSTALL = f'''\
# Colab only: clone foldax, install it with a JAX recent enough for it (Colab
# ships an older jax; if jax was imported before this cell, restart the
# session once after it). Elsewhere: `pip install -e ".[dev,hf]"` in a clone.
import os, subprocess, sys
if "google.colab" in sys.modules:
    url = os.environ.get("FOLDAX_GIT_URL", "{GIT_URL}")
    if not os.path.isdir("/content/foldax"):
        subprocess.run(["git", "clone", "--depth", "1", url, "/content/foldax"], check=True)
    gpu = subprocess.run(["nvidia-smi"], capture_output=True).returncode == 0
    # Colab's NVIDIA drivers are CUDA 12; the project's own `cuda` extra is CUDA 13.
    jax_req = "jax[cuda12]>=0.11,<0.12" if gpu else "jax>=0.11,<0.12"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-U", jax_req,
                    "-e", "/content/foldax[hf]"], check=True)
    sys.path.insert(0, "/content/foldax")
    os.chdir("/content/foldax")
'''

BACKEND = '''\
# Which implementation runs here, and how big the examples are.
import os
import jax

dev = jax.devices()[0]
cc = getattr(dev, "compute_capability", None)
cc_tuple = tuple(int(x) for x in str(cc).split(".")) if cc else None
# Small sizes on a CPU, or whenever FOLDAX_NB_SMALL=1 (what the tests set).
SMALL = os.environ.get("FOLDAX_NB_SMALL", "0" if dev.platform == "gpu" else "1") == "1"
# backend="auto" = the Pallas kernel (Triton) on NVIDIA GPUs of compute
# capability 8.0+, the XLA path elsewhere. On a CPU these notebooks pass
# "interpret": the same Pallas kernel, interpreted (exact, slow, small sizes).
BACKEND = "auto" if dev.platform == "gpu" else "interpret"
if dev.platform == "gpu" and cc_tuple and cc_tuple >= (8, 0):
    print(f"{dev.device_kind} (compute capability {cc}): Pallas kernels lowered through Triton")
elif dev.platform == "gpu":
    print(f"{dev.device_kind} (compute capability {cc} < 8.0, e.g. a T4): the XLA path")
else:
    print(f"{dev.platform.upper()}: backend='auto' would run the XLA path; "
          "this notebook uses backend='interpret' (the Pallas kernel on CPU)")
print(f"jax {jax.__version__} | BACKEND={BACKEND!r} | small sizes: {SMALL}")
'''


def header(title: str, intro: str, before_jax: str | None = None) -> list:
  """Title, the install cell and the backend cell (which starts JAX), that
  one led by `before_jax` where given."""
  backend = BACKEND if before_jax is None else before_jax + "\n" + BACKEND
  return [new_markdown_cell(f"# {title}\n\n{intro.strip()}"),
          new_code_cell(INSTALL), new_code_cell(backend)]


def md(s: str):
  return new_markdown_cell(s.strip())


def code(s: str):
  return new_code_cell(s.strip("\n"))


# ----------------------------------------------------------------------------
NB01 = header("foldax quick start", """
`fold_attn_func` is exact flash attention for JAX: causal masks, GQA, sliding
windows, softcap, sinks; differentiable; and a backward pass that gives **the
same bits on every run and for every batch composition**. This notebook calls
it, checks it against plain attention, takes gradients and checks the
determinism.""") + [
    md("## Forward\nLayout `[batch, seq, heads, head_dim]`; here 4 query heads "
       "share 2 key/value heads (GQA)."),
    code('''
import jax.numpy as jnp
from jax_api import fold_attn_func

B, S, H, H_KV, D = (2, 256, 4, 2, 64) if SMALL else (2, 2048, 16, 4, 128)
dtype = jnp.float32 if SMALL else jnp.bfloat16
kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(kq, (B, S, H, D), dtype)
k = jax.random.normal(kk, (B, S, H_KV, D), dtype)
v = jax.random.normal(kv, (B, S, H_KV, D), dtype)

out = fold_attn_func(q, k, v, causal=True, backend=BACKEND)
print(out.shape, out.dtype)
'''),
    md("Compare with JAX's own attention, computed in float32:"),
    code('''
def reference(q, k, v):
    f32 = lambda x: x.astype(jnp.float32)
    return jax.nn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True)

ref = reference(q, k, v)
rel = jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
print(f"relative error vs float32 reference: {rel:.1e}")
assert rel < 2e-2
'''),
    md("## Gradients\n`fold_attn_func` is a `jax.custom_vjp`: use it under "
       "`jax.grad`, `jax.jit`, `jax.vmap`, `jax.checkpoint` like any JAX "
       "function."),
    code('''
do = jax.random.normal(kd, q.shape, dtype)   # a fixed upstream gradient

def loss(q, k, v, attn):
    return jnp.sum(attn(q, k, v).astype(jnp.float32) * do)

grad_fold = jax.jit(jax.grad(
    lambda q, k, v: loss(q, k, v, lambda *a: fold_attn_func(*a, causal=True, backend=BACKEND)),
    argnums=(0, 1, 2)))
grad_ref = jax.jit(jax.grad(lambda q, k, v: loss(q, k, v, reference), argnums=(0, 1, 2)))

dq, dk, dv = grad_fold(q, k, v)
for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), grad_ref(q, k, v)):
    err = jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b)
    print(f"{name} {tuple(a.shape)}  relative error {err:.1e}")
    assert err < 2e-2
'''),
    md("## Determinism\nNo float atomics anywhere: the backward gives the same "
       "bits every time, and a sequence gets the same bits whether it runs "
       "alone or inside a batch."),
    code('''
def same_bits(a, b):
    return bool(jnp.array_equal(a.view(jnp.uint32 if a.dtype.itemsize == 4 else jnp.uint16),
                                b.view(jnp.uint32 if b.dtype.itemsize == 4 else jnp.uint16)))

runs = [grad_fold(q, k, v) for _ in range(3)]
repeatable = all(same_bits(a, b) for r in runs[1:] for a, b in zip(runs[0], r))
print("backward bitwise repeatable over 3 runs:", repeatable)

alone = fold_attn_func(q[:1], k[:1], v[:1], causal=True, backend=BACKEND)
print("sequence 0 alone == sequence 0 in the batch (bitwise):", same_bits(alone[0], out[0]))
assert repeatable and same_bits(alone[0], out[0])
'''),
    md("## Packed variable-length batches\n`fold_attn_varlen_func` takes "
       "`[total_tokens, heads, head_dim]` and cumulative lengths, as "
       "FlashAttention's varlen API does."),
    code('''
from jax_api import fold_attn_varlen_func

lens = [S // 2, S // 4, S // 4]
cu = jnp.array([0, lens[0], lens[0] + lens[1], S], jnp.int32)
packed = fold_attn_varlen_func(q[0], k[0], v[0], cu, causal=True, backend=BACKEND)
first = fold_attn_func(q[:1, :lens[0]], k[:1, :lens[0]], v[:1, :lens[0]], causal=True, backend=BACKEND)
print("packed sequence 0 == the same sequence alone (bitwise):", same_bits(packed[:lens[0]], first[0]))
'''),
]

# ----------------------------------------------------------------------------
NB02 = header("Training a Flax model with foldax attention", """
Swap the attention of a Flax model for foldax's and train it with a
jit-compiled step. `jax_api.flax.attention_fn` is a drop-in `attention_fn`
for `flax.linen.MultiHeadDotProductAttention` (and `flax.nnx.MultiHeadAttention`).
Because the backward is deterministic, two training runs from the same seed
end with bitwise-identical weights.""") + [
    code('''
import functools
import flax.linen as nn
import jax.numpy as jnp
import optax

try:
    from jax_api.flax import attention_fn as fold_attention_fn
    fold_attention = functools.partial(fold_attention_fn, is_causal=True, backend=BACKEND)
    print("using jax_api.flax.attention_fn")
except ImportError:  # older foldax: wrap fold_attn_func ourselves
    from jax_api import fold_attn_func
    def fold_attention(q, k, v, *args, **kwargs):
        return fold_attn_func(q, k, v, causal=True, backend=BACKEND)
    print("jax_api.flax not available: using fold_attn_func directly")

def flax_attention(q, k, v, *args, **kwargs):   # Flax's default, with a causal mask
    return nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones(q.shape[:2])))
'''),
    md("A tiny causal language model; `attn_fn` is the only thing we swap."),
    code('''
V, S, D, HEADS, LAYERS, BATCH = (32, 64, 64, 4, 2, 8) if SMALL else (256, 1024, 512, 8, 4, 16)

class Block(nn.Module):
    attn_fn: callable
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=self.attn_fn)(h, h)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(h)))

class TinyLM(nn.Module):
    attn_fn: callable
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D)(tokens) + self.param("pos", nn.initializers.normal(0.02), (S, D))
        for _ in range(LAYERS):
            x = Block(self.attn_fn)(x)
        return nn.Dense(V)(nn.LayerNorm()(x))

def make_batch(key):
    """Arithmetic sequences mod V: the next token is predictable from the context."""
    k1, k2 = jax.random.split(key)
    start = jax.random.randint(k1, (BATCH, 1), 0, V)
    step = jax.random.randint(k2, (BATCH, 1), 1, 4)
    return (start + step * jnp.arange(S)) % V

model = TinyLM(fold_attention)
params = model.init(jax.random.key(0), make_batch(jax.random.key(1)))
tokens = make_batch(jax.random.key(2))
diff = jnp.max(jnp.abs(model.apply(params, tokens) - TinyLM(flax_attention).apply(params, tokens)))
print(f"same weights, foldax vs Flax attention: max |logit difference| = {diff:.1e}")
'''),
    md("## A jit-compiled training step"),
    code('''
optimizer = optax.adam(3e-3)

def loss_fn(params, tokens):
    logits = model.apply(params, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

@jax.jit
def train_step(params, opt_state, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, make_batch(key))
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

def train(steps):
    p, s, losses = params, optimizer.init(params), []
    for i in range(steps):
        p, s, loss = train_step(p, s, jax.random.key(100 + i))
        losses.append(float(loss))
    return p, losses

STEPS = 40 if SMALL else 200
trained, losses = train(STEPS)
print(f"loss: {losses[0]:.3f} -> {losses[-1]:.3f} after {STEPS} steps")
assert losses[-1] < losses[0]
'''),
    md("## Reproducible training\nSame seed, same data order: the weights "
       "after training are identical to the last bit."),
    code('''
again, _ = train(STEPS)
identical = all(bool(jnp.array_equal(a, b)) for a, b in
                zip(jax.tree.leaves(trained), jax.tree.leaves(again)))
print("two training runs give bitwise-identical weights:", identical)
assert identical
'''),
]

# ----------------------------------------------------------------------------
ALLOCATOR = '''\
# Before JAX starts (below): JAX would take 75% of the GPU up front,
# leaving torch a quarter; this makes JAX's GPU memory grow on demand instead.
try:
    import torch_bridge
    torch_bridge.configure_jax_allocator()
except ImportError:
    pass  # no torch here: the cells below say so
'''

NB03 = header("foldax from PyTorch and Hugging Face", """
`torch_bridge` runs the same kernels on torch tensors (through DLPack, no
copies on the GPU): `torch_bridge.fold_attn_func` as a torch autograd
function, `attn_implementation="fold"` for Hugging Face decoder models, and
`torch_bridge.optimize_deberta(model)` for DeBERTa-v2/v3. Each section checks
what this installation provides and says so when a part is not there yet.""", ALLOCATOR) + [
    code('''
import importlib, importlib.util, warnings
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm in a bare kernel
try:
    import torch_bridge
    import torch
except ImportError as e:  # torch is an extra: pip install "foldax[torch]"
    print("PyTorch or torch_bridge is not installed:", e)
    torch = None

def have(mod, attr=None):
    try:
        if importlib.util.find_spec(mod) is None:
            return False
        return attr is None or hasattr(importlib.import_module(mod), attr)
    except ImportError:
        return False

HAVE_FUNC = torch is not None and have("torch_bridge", "fold_attn_func")
HAVE_HF = torch is not None and have("torch_bridge.hf", "register") and have("transformers")
HAVE_DEBERTA = torch is not None and have("torch_bridge", "optimize_deberta") and have("transformers")
if torch is not None:
    print(f"torch {torch.__version__}")
print(f"torch_bridge.fold_attn_func:       {'yes' if HAVE_FUNC else 'not available yet'}")
print(f'attn_implementation="fold" (HF):  {"yes" if HAVE_HF else "not available yet"}')
print(f"torch_bridge.optimize_deberta:     {'yes' if HAVE_DEBERTA else 'not available yet'}")
'''),
    md("## `torch_bridge.fold_attn_func`\nFlashAttention's layout `[batch, "
       "seq, heads, head_dim]`; gradients flow back to torch."),
    code('''
if HAVE_FUNC:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, S, H, D = (2, 128, 4, 64) if SMALL else (4, 4096, 16, 128)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device=device, dtype=dt, generator=g, requires_grad=True)
               for _ in range(3))
    out = torch_bridge.fold_attn_func(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.detach().float().transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)
    print("max |foldax - torch SDPA| =", (out.float() - ref).abs().max().item())
    out.float().square().sum().backward()
    print("dq norm:", q.grad.norm().item())
else:
    print("torch_bridge.fold_attn_func is not in this version of foldax yet (issue 7).")
'''),
    md('## Hugging Face: `attn_implementation="fold"`\nA tiny random Llama '
       '(no download), left-padded, compared with the eager attention.'),
    code('''
if HAVE_HF:
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch_bridge.hf
    torch_bridge.hf.register()
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    mask = torch.ones_like(ids)
    mask[1, :8] = 0                                   # left padding in row 1
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("fold")
        fold = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    print("max |fold - eager| on real tokens:", (fold - eager)[valid].abs().max().item())
    gen = model.generate(ids[:1, :16], max_new_tokens=8, do_sample=False)
    print("greedy continuation with fold attention:", gen[0, 16:].tolist())
else:
    print('attn_implementation="fold" needs torch_bridge.hf (issue 7), not in this version yet.')
'''),
    md("## DeBERTa-v2/v3: `optimize_deberta`\nDeBERTa does not use the "
       "attention registry, so the bridge swaps its `DisentangledSelfAttention` "
       "modules in place (weights and names unchanged)."),
    code('''
if HAVE_DEBERTA:
    from transformers import DebertaV2Config, DebertaV2Model
    cfg = DebertaV2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=128, max_position_embeddings=128, relative_attention=True,
                          position_buckets=32, max_relative_positions=64, pos_att_type=["c2p", "p2c"],
                          norm_rel_ebd="layer_norm", position_biased_input=False,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = DebertaV2Model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 48))
    with torch.no_grad():
        before = model(ids).last_hidden_state
        torch_bridge.optimize_deberta(model)
        after = model(ids).last_hidden_state
    print("max |optimized - original| =", (after - before).abs().max().item())
else:
    print("torch_bridge.optimize_deberta is not in this version of foldax yet (issue 7).")
'''),
]

# ----------------------------------------------------------------------------
NB04 = header("Serving: KV cache and decoding", """
`FoldKVCache` is a paged KV cache (a pytree: jit it, donate it);
`cache.prefill` runs causal attention over packed prompts and stores their
keys and values, `fold_attn_with_kvcache` appends one token per sequence and
attends over the cache. Decoding is exact, and its result has the same bits
however the work is split across the GPU.""") + [
    code('''
import jax.numpy as jnp
import numpy as np

try:
    from jax_api import FoldKVCache, fold_attn_with_kvcache
except ImportError:
    try:
        from jax_api.kvcache import FoldKVCache, fold_attn_with_kvcache
    except ImportError:
        FoldKVCache = None
print("FoldKVCache available:", FoldKVCache is not None)
'''),
    md("## Prefill two prompts of different lengths"),
    code('''
if FoldKVCache is not None:
    H, H_KV, D = (4, 2, 64) if SMALL else (32, 8, 128)
    lens = [37, 20] if SMALL else [3000, 1200]
    PAGE = 16 if SMALL else 256
    dtype = jnp.float32 if SMALL else jnp.bfloat16
    cache = FoldKVCache.create(batch=2, n_heads=H, n_kv_heads=H_KV, head_dim=D,
                               max_len=4 * max(lens), page_size=PAGE, chunk_tokens=PAGE, dtype=dtype)
    print(cache)
    total = sum(lens)
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (total, H, D), dtype)
    k = jax.random.normal(kk, (total, H_KV, D), dtype)
    v = jax.random.normal(kv, (total, H_KV, D), dtype)
    cu_seqlens = jnp.array(np.cumsum([0] + lens), jnp.int32)
    out, cache = cache.prefill(q, k, v, cu_seqlens, backend=BACKEND)
    print("prompt output", out.shape, "| tokens per slot:", cache.lengths.tolist())
else:
    print("FoldKVCache is not in this version of foldax yet.")
'''),
    md("## Decode a few tokens with a jitted step"),
    code('''
if FoldKVCache is not None:
    step = jax.jit(lambda q, cache, k, v: fold_attn_with_kvcache(q, cache, k, v, backend=BACKEND))
    new_k, new_v = [], []
    for t in range(4):
        a, b, c = jax.random.split(jax.random.key(10 + t), 3)
        q_t = jax.random.normal(a, (2, H, D), dtype)
        k_t = jax.random.normal(b, (2, H_KV, D), dtype)
        v_t = jax.random.normal(c, (2, H_KV, D), dtype)
        o_t, cache = step(q_t, cache, k_t, v_t)
        new_k.append(k_t); new_v.append(v_t)
    print("tokens per slot after 4 steps:", cache.lengths.tolist())

    # The last step of slot 0 equals plain attention of its query over every key so far.
    from jax_api import fold_attn_func
    keys = jnp.concatenate([k[:lens[0]]] + [x[0][None] for x in new_k])
    vals = jnp.concatenate([v[:lens[0]]] + [x[0][None] for x in new_v])
    ref = fold_attn_func(q_t[:1, None], keys[None], vals[None], backend="xla")[0, 0]
    print("max |decode - dense attention| =", float(jnp.max(jnp.abs(o_t[0] - ref))))
'''),
    md("## Split invariance\nLong contexts are split across thread blocks; "
       "partial results are added in a fixed order, so every split count gives "
       "the same bits."),
    code('''
if FoldKVCache is not None:
    outs = {n: cache.attend(q_t, num_splits=n, backend=BACKEND) for n in (1, 2, 3)}
    same = all(bool(jnp.array_equal(outs[1], o)) for o in outs.values())
    print("num_splits 1, 2, 3 give bitwise-identical outputs:", same)
    assert same
    cache = cache.free(jnp.array([0]))              # slot 0's pages go back to the pool
    print("after freeing slot 0:", cache.lengths.tolist(), "| free pages:", int(cache.n_free))
'''),
]

# ----------------------------------------------------------------------------
NB05 = header("Benchmarks", """
Runs a small benchmark with `python -m benchmarks.run` and plots it with
`python -m benchmarks.plot`, then shows the committed results from the lent
NVIDIA H200. On a CPU the run is a smoke test (the Pallas kernel interpreted):
it shows the harness works, not speed.""") + [
    code('''
import subprocess, sys, tempfile
from pathlib import Path
from IPython.display import Image, Markdown, display

ROOT = next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "benchmarks" / "run.py").exists()), None)
assert ROOT is not None, "run this notebook from inside a clone of foldax"
work = Path(tempfile.mkdtemp(prefix="foldax_bench_"))
results = work / "results.json"
if SMALL:   # two short lengths, ours against XLA: a few seconds per measurement
    cmd = ["--suite", "dense", "--dense-args",
           "--impls ours,jax_xla --no-checks --shapes b1-h4-kv2-s128-d32-causal b1-h4-kv2-s256-d32-causal"]
else:       # GPU: the two anchor shapes, ours against cuDNN and JAX's Pallas attention
    cmd = ["--suite", "dense", "--quick", "--no-det-cudnn", "--dense-args", "--impls ours,jax_cudnn,pallas_mha"]
cmd = [sys.executable, "-m", "benchmarks.run", "--output", str(results), *cmd]
print(" ".join(cmd[1:]))
r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
print(r.stdout[-3000:])
assert r.returncode == 0, r.stderr[-3000:]
'''),
    md("## Plot it"),
    code('''
sys.path.insert(0, str(ROOT))
from benchmarks import plot

figures = plot.plot_all([results], work / "figures")
for f in figures:
    if f.suffix == ".png":
        display(Image(filename=str(f), width=900))
'''),
    md("## The committed H200 results\nMeasured on the lent H200 and "
       "committed with their JSON in `benchmarks/results/h200/`."),
    code('''
h200 = ROOT / "benchmarks" / "results" / "h200"
for name in ("dense_speedup.png", "dense_memory.png"):
    if (h200 / name).exists():
        display(Image(filename=str(h200 / name), width=900))
if (h200 / "table.md").exists():
    display(Markdown((h200 / "table.md").read_text().split("\\n## ")[0]))
'''),
]

NOTEBOOKS = {
    "01_quickstart.ipynb": NB01,
    "02_flax_training.ipynb": NB02,
    "03_pytorch_huggingface.ipynb": NB03,
    "04_serving.ipynb": NB04,
    "05_benchmarks.ipynb": NB05,
}


def build(name: str) -> nbformat.NotebookNode:
  nb = new_notebook(cells=NOTEBOOKS[name])
  nb.metadata = {
      "kernelspec": {"display_name": "Python 3", "language": "python",
                     "name": "python3"},
      "language_info": {"name": "python"},
      "accelerator": "GPU",
      "colab": {"provenance": []},
  }
  for i, c in enumerate(nb.cells):  # stable ids: no churn on rebuild
    c["id"] = f"{Path(name).stem[:2]}-{i:02d}"
  return nb


def main() -> int:
  for name in NOTEBOOKS:
    nb = build(name)
    nbformat.validate(nb)
    (HERE / name).write_text(nbformat.writes(nb) + "\n")
    print(HERE / name)
  return 0


if __name__ == "__main__":
  sys.exit(main())
