"""Interfaces that meet users in their own tensor layouts and frameworks, one module each.

``doc_packed``: ``doc_packed_attn``, a ``torch.library`` custom op over ``[B, S, H, D]`` rows of
packed documents (opcheck-, compile- and DTensor-ready; rules in ``doc_packed_sharding``).
``padded``: the padded one-document-per-row API.
"""
