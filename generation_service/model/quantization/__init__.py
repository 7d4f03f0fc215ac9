"""FP8 e4m3 linear layers: checkpoints in the compressed-tensors and Hugging Face fp8 forms
(`scheme.py`), online quantization of a float model (`apply.py`), the layer (`linear.py`) and
its fp32 reference numerics (`fp8.py`)."""
