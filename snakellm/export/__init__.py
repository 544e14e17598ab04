"""Artifacts that leave the workflow: ``.nemo`` files (:mod:`.nemo`) and Hugging Face directories."""
