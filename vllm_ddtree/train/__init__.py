"""Self-distillation data and DFlash training for the drafter."""
