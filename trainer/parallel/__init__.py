"""The process group and what runs over it: joining it (context), the helpers for who does what
(collectives), the stop (stop), how the model is spread (strategy: ddp or fsdp) and the shared-memory
collectives of CPU processes on one host."""
