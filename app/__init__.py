"""MoE Chat's desktop GUI (PySide6).

It talks to the engine only through the worker protocol and never imports
torch, transformers or safetensors, so the window starts fast and needs no CUDA
context.
"""
