"""Speculative decoding on top of the models: sampling rules, proposers (DFlash, MTP, oracle), the
on-device loop with its typed state and phases, and the host API (generate, stream, make_generate).
"""
