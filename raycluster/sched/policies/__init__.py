"""Priority policies, one module each; `raycluster.sched.registry` maps names to classes."""
