"""batchspec tune: measure speculation candidates on a job's prompts and recommend one."""
