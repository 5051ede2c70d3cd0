"""One instance's engine: paged KV manager, scheduler, model runner, sampler, step loop."""
