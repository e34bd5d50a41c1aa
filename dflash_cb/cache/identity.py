"""A cache's identity is its content: what two caches must share for their figures to be comparable.

The manifest file's own sha256 (``StateCache.manifest_sha256``) also covers where the target was read from
(``target.name_or_path``) and the tokenizer's path: two caches built from the same checkpoint in two folders
(``demo_out/target``, ``demo2_out/target``; two hosts) would differ by it alone. The identity leaves those
paths out and keeps everything that shapes the data: the target's config hash and shape, the layers, dtypes,
the completion source and its settings, the prompt file's sha256, every sample entry and every shard's
sha256 (the states the target's weights computed). ``identity`` is small enough for a results file's meta
(the samples and shards lists stand as their sha256), so a comparison can name the field that differs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

# Paths that may differ between hosts for the same checkpoint; everything else that shapes the data may not.
LOCAL_PATHS = ("target.name_or_path", "prompts.tokenizer")
# Lists as long as the cache that stand in the identity as the sha256 of their canonical JSON.
_HASHED = ("samples", "shards", "agreement.first_disagreements")
IDENTITY_KEY = "cache_identity"  # results meta: the identity
CONTENT_KEY = "cache_content_sha256"  # results meta: its sha256


def _sha256(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def identity(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The content of a manifest (its dict, ``Manifest.to_dict``) without the local paths, its long lists as
    their sha256."""
    out = dict(manifest)
    for path in (*LOCAL_PATHS, *_HASHED):
        section, _, key = path.rpartition(".")
        parent = out
        if section:
            if not isinstance(out.get(section), Mapping):
                continue
            parent = out[section] = dict(out[section])  # a copy: the manifest's own dict stays as it was
        if key in parent:
            if path in _HASHED:
                parent[key] = _sha256(parent[key])
            else:
                del parent[key]
    return out


def content_sha256(ident: Mapping[str, Any]) -> str:
    """The identity's sha256 (canonical JSON): equal for two caches of the same content wherever built."""
    return _sha256(ident)


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``{"target.name_or_path": value}`` (an empty dict stays a value)."""
    if isinstance(d, Mapping) and d:
        return {k: v for key, val in d.items() for k, v in flatten(val, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): d}


def differing_fields(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The dotted names of the fields two nested dicts disagree on (identities: ``samples``, ``shards`` stand for
    their entries)."""
    fa, fb = flatten(a), flatten(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k, "<absent>") != fb.get(k, "<absent>"))


def cache_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """Why two results files' caches (their meta) are not the same content, or None when they are.

    Files written before the identity was recorded carry only ``cache_manifest_sha256``: they are compared by
    it, as they were."""
    ca, cb = a.get(CONTENT_KEY), b.get(CONTENT_KEY)
    if ca and cb:
        if ca == cb:
            return None
        ia, ib = a.get(IDENTITY_KEY), b.get(IDENTITY_KEY)
        fields = differing_fields(ia, ib) if isinstance(ia, Mapping) and isinstance(ib, Mapping) else []
        return (f"the caches differ in {', '.join(fields[:6])}" if fields
                else f"cache content sha256 {str(ca)[:12]}... vs {str(cb)[:12]}...")
    ma, mb = a.get("cache_manifest_sha256"), b.get("cache_manifest_sha256")
    if ma == mb:
        return None
    return (f"manifest sha256 {str(ma)[:12]}... vs {str(mb)[:12]}... (a file written before dflash-cb recorded "
            "the cache's content identity: score it again to compare by content)")
