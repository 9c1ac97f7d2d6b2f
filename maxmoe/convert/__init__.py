"""Checkpoint conversion: DeepSeek-V3 / Hugging Face safetensors <-> maxmoe parameters."""
