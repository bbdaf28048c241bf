"""Triton's CPU interpreter re-patches `triton.language` on every call of a nested `@triton.jit`
helper (`InterpretedFunction.__call__` -> `_patch_lang`), although the launch that is running has
already patched the same modules and the helper's patch is never undone. Each of those calls
walks the members of four modules with `inspect.getmembers`: in the whole-model kernel test
(tests/test_kernels_model.py) that was 42,326 calls and 27% of the run (cProfile, Triton 3.9).

`skip_nested_repatching()` makes a helper's call skip the patch when the running launch already
patched every language module the helper can see (its `triton.language` / `triton.language.core`
globals). A helper that sees a module the launch did not patch (`tl.zeros`, say, sees
`triton.language.core`) is patched as before, once a launch. Nothing else in the interpreter
changes, and where its private names differ (another Triton release) this does nothing at all, so
the suite runs on the stock interpreter there.
"""
from __future__ import annotations


def _language_modules(fn) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def skip_nested_repatching() -> bool:
    """Install the skip; returns whether it is active (False on an interpreter without the hooks)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    grid_executor = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or grid_executor is None or scope_type is None:
        return False
    if getattr(patch_lang, "skips_nested", False):
        return True
    launch = grid_executor.__call__
    # one entry per launch in progress: the language modules patched so far in it
    patched: list[frozenset[int]] = []

    def launch_tracked(self, *args, **kwargs):
        patched.append(frozenset())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def patch_lang_once(fn):
        langs = _language_modules(fn)
        if patched and langs and langs <= patched[-1]:
            return scope_type()  # an empty scope: nothing was changed, nothing to restore
        scope = patch_lang(fn)
        if patched:  # the launch's own patch, or a helper's of a module the launch had not patched
            patched[-1] |= langs
        return scope

    patch_lang_once.skips_nested = True
    grid_executor.__call__ = launch_tracked
    interpreter._patch_lang = patch_lang_once
    return True
