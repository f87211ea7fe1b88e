"""Checkpoints: DCP save/load committed atomically and verified (manager.py), the folder's rules
(folder.py: committed, in-progress, damaged), what a resume takes from the recipe vs the checkpoint
(resume.py), and Hugging Face safetensors in and out (hf.py).
"""
