"""The in-process side of gpumon: sampler, socket server, memory sources.

Standard library only (torch is taken from ``sys.modules`` once the program has imported it,
pynvml is optional), so that it can run inside any training process, even one where gpumon was
injected rather than installed. It imports nothing of the UI.
"""
