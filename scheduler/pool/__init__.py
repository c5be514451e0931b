"""Cross-model autoscaling on a shared pool (seed 004): pure functions, no Django, no clock.

    twu.py        token-weighted utilisation from engine reports: per plan, per GPU, per deployment
    autoscale.py  the scale rule on TWU windows (`scale_signal`) and per-model soft limits
                  (`admission_shares`)
    jobs.py       fine-tune and batch jobs on the pool (priority 1): booking, yield with a
                  checkpoint inside a grace time, resume; which job GPUs a deployment may take
    zero.py       scale to zero after the idle time (`idle_signal`), and the wake-up's reason
    sharing.py    GPUs shared by memory fraction: the snapshot one deployment decides on
                  (`shared_snapshot`, max_models_per_gpu) and the stores' reservation check
    priority.py   which lower-priority holder gives which GPUs to a higher one (`choose_givers`)
"""
