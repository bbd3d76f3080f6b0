"""Test session setup: a fresh Inductor cache for each session. Inductor's
cache keys do not cover a custom operator's fake kernel, so graphs compiled
against an earlier build of moe_reroute (other output shapes) would be
reused (docs/torch.md). The directory is removed when the session's
interpreter exits."""

import os
import tempfile

_INDUCTOR_CACHE = tempfile.TemporaryDirectory(prefix="moe_reroute_inductor_",
                                              ignore_cleanup_errors=True)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE.name
