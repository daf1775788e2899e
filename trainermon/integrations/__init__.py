"""Callbacks for training frameworks that own the loop: `hf.TrainerMonCallback` (Hugging Face `Trainer`)
and `lightning.TrainerMonCallback` (Lightning). Each module imports its framework; importing `trainermon`
imports neither."""
