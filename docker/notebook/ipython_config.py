# Every IPython kernel of the notebook image loads gpubroker's magics
# (%gpu, %gpu_submit, %%gpu_job, %gpu_jobs, %gpu_logs, %gpu_cancel).
c = get_config()  # noqa: F821 - provided by IPython
c.InteractiveShellApp.extensions = ["gpubroker"]
