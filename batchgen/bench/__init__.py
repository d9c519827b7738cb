"""`batchgen bench`: one process, one checkpoint, the same workloads through `transformers`
`generate`, `transformers` `generate_batch`, BatchGen `lockstep` and BatchGen `coalesce`."""
