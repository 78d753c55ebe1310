"""The core install (``pip install .``, JAX and NumPy only) is enough for the routers and the MoE
layer's pure functions.

A subprocess stands in for that install: a ``sys.meta_path`` finder, installed before anything
else is imported, makes the packages of the extras unimportable, as they are in an environment
without them. Cheaper than building a virtual environment, and it fails the same way: any module
on the path from ``sparsemixer_jax.routers`` (or ``sparsemixer_jax.moe``'s pure functions) to
one of these packages raises ImportError.
"""

import subprocess
import sys
import textwrap

# Top-level packages that only the extras install (pyproject.toml): [train], [experiments],
# [hf], [test].
BLOCKED = (
    "flax", "optax", "orbax", "chex", "ml_collections", "absl", "sentencepiece", "sacrebleu",
    "sacremoses", "tensorflow", "tensorflow_datasets", "tensorboardX", "tqdm", "matplotlib",
    "safetensors", "tokenizers", "sklearn",
)

BLOCKER = f"""
import sys

BLOCKED = {BLOCKED!r}


class Blocker:
    # Consulted before the real finders: a blocked package is missing, as without its extra.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed (blocked by the test)")
        return None


sys.meta_path.insert(0, Blocker())
"""


def run_without_extras(code: str) -> str:
    """Run ``code`` after the blocker in a fresh interpreter; its stdout. Fails the test with the
    child's stderr if it exits non-zero."""
    result = subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_router_imports_and_routes_without_the_extras():
    out = run_without_extras("""
        import jax
        import jax.numpy as jnp

        import sparsemixer_jax
        from sparsemixer_jax.routers import (
            ROUTERS, get_router, load_balancing_loss, router_z_loss, sparsemixer_route,
        )

        logits = jax.random.normal(jax.random.key(0), (8, 4))

        def loss(z):
            out = sparsemixer_route(z, jax.random.key(1), jitter_eps=0.1, training=True)
            return (jnp.sum(out.gate) + load_balancing_loss(out.probs, out.expert)
                    + router_z_loss(z))

        grad = jax.grad(loss)(logits)
        assert grad.shape == (8, 4) and bool(jnp.all(jnp.isfinite(grad)))
        assert bool(jnp.any(grad != 0))
        # Every router by name, and the package root's names the README shows.
        for name in ROUTERS:
            get_router(name, 0.1)(logits, jax.random.key(2), True)
        assert sparsemixer_jax.sparsemixer_route is sparsemixer_route
        assert sparsemixer_jax.load_balancing_loss is load_balancing_loss
        from sparsemixer_jax import get_router as root_get_router, switch_route  # noqa: F401

        # The exact-gradient oracle, which checks estimators, needs JAX alone too.
        from sparsemixer_jax import exact
        problem = exact.random_problem(jax.random.key(3), num_experts=3, dim=2)
        assert exact.exact_gradient(problem, lambda z: jax.nn.softmax(z)).loss.shape == ()

        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, f"imported without need: {loaded}"
        print("routed")
    """)
    assert "routed" in out


def test_moe_pure_functions_run_without_the_extras():
    out = run_without_extras("""
        import jax
        import jax.numpy as jnp

        from sparsemixer_jax.moe import expert_capacity, expert_ffn
        from sparsemixer_jax.moe.diagnostics import router_diagnostics
        from sparsemixer_jax.moe.expert_parallel import expert_parallel_ffn  # noqa: F401
        from sparsemixer_jax.moe.unchosen import all_expert_outputs, update_expert_defaults
        from sparsemixer_jax.routers import switch_route

        rows, emb, mlp, n = 6, 4, 8, 3
        keys = jax.random.split(jax.random.key(0), 5)
        x = jax.random.normal(keys[0], (rows, emb))
        params = (jax.random.normal(keys[1], (n, emb, mlp)), jnp.zeros((n, mlp)),
                  jax.random.normal(keys[2], (n, mlp, emb)), jnp.zeros((n, emb)))
        group = jnp.array([0, 2, 1, 0, 3, 2], jnp.int32)  # 3: no expert, zeros out
        y = expert_ffn(x, group, jnp.arange(rows), params, dispatch="ragged")
        dense = all_expert_outputs(x, params)
        ref = dense[jnp.arange(rows), jnp.minimum(group, n - 1)]
        assert bool(jnp.allclose(y[group < n], ref[group < n], atol=1e-5))
        assert bool(jnp.all(y[group == n] == 0))
        defaults = update_expert_defaults(jnp.zeros((n, emb)), y, group, 0.9)
        assert defaults.shape == (n, emb)
        routed = switch_route(jax.random.normal(keys[3], (2, 3, n)), None, jitter_eps=0.0,
                              training=False)
        router_diagnostics(jax.random.normal(keys[3], (2, 3, n)), routed, None, jitter_eps=0.1)
        assert expert_capacity(1.25, rows, n) == 3

        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, f"imported without need: {loaded}"
        # The layer itself needs Flax: with Flax missing, it fails to import, and only it.
        try:
            from sparsemixer_jax.moe import MoEFeedForward  # noqa: F401
        except ImportError as e:
            assert "flax" in str(e), e
        else:
            raise AssertionError("MoEFeedForward imported without Flax: is the blocker on?")
        print("dispatched")
    """)
    assert "dispatched" in out


def test_a_module_needing_a_missing_extra_names_the_extra():
    """Without Flax (hidden from Python's path finder, as where it is not installed), importing
    what needs it is a ModuleNotFoundError that names the extra to install."""
    out = run_without_extras("""
        import importlib.machinery

        import sparsemixer_jax  # its finder asks after every other one has found nothing

        class HidingPathFinder(importlib.machinery.PathFinder):
            @classmethod
            def find_spec(cls, name, path=None, target=None):
                if name.split(".")[0] in ("flax", "safetensors"):
                    return None
                return super().find_spec(name, path, target)

        sys.meta_path[:] = [HidingPathFinder if f is importlib.machinery.PathFinder else f
                            for f in sys.meta_path if f.__class__.__name__ != "Blocker"]
        for module, extra in (("sparsemixer_jax.hf", "train"), ("safetensors", "hf")):
            try:
                __import__(module)
            except ModuleNotFoundError as e:
                print(f"{module}: {e}")
                assert f"pip install 'sparsemixer-jax[{extra}]'" in str(e), e
            else:
                raise AssertionError(f"{module} imported: is the finder on?")
        try:
            sparsemixer_jax.MoEFeedForward
        except ModuleNotFoundError as e:
            assert e.name == "flax" and "sparsemixer-jax[train]" in str(e), e
        print("named")
    """)
    assert "named" in out and "No module named 'flax': it comes with sparsemixer-jax's " \
        "train extra" in out


def test_a_probe_for_a_missing_extra_is_answered_none(monkeypatch):
    """``importlib.util.find_spec`` asks whether a package is installed (orbax's paths and JAX's
    compilation cache ask it of tensorflow): it gets None, as without the finder; only an
    import raises the error that names the extra."""
    import importlib.util

    import pytest

    from sparsemixer_jax import extras

    extras.name_missing_extras()
    monkeypatch.setitem(extras.EXTRA_OF, "sparsemixer_no_such_package", "train")
    assert importlib.util.find_spec("sparsemixer_no_such_package") is None
    with pytest.raises(ModuleNotFoundError, match=r"sparsemixer-jax\[train\]"):
        __import__("sparsemixer_no_such_package")
