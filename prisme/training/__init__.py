"""Training: stage configs and datasets (`config`), the stage objectives (`objectives`), DDP/FSDP2 plumbing
(`distributed`) and the stage loop with exact resume (`trainer`)."""
