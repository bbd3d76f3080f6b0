"""Test session setup: a fresh Inductor cache for each session. Inductor's
cache keys do not cover a custom operator's fake kernel, so graphs compiled
against an earlier build of moe_reroute (other output shapes) would be
reused (docs/torch.md)."""

import os
import tempfile

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe_reroute_inductor_")
