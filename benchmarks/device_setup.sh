# Sourced by the device batch scripts: NVLink multicast off (the host's GPUs are shared), the cp312
# wheels in .whl/ and v4launch itself installed into /tmp/site (the machine has no internet).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
REPO=$PWD
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
pip install -q --upgrade --no-index --no-deps --no-build-isolation --target /tmp/site . >/dev/null 2>&1 || echo "install of v4launch failed"
export PYTHONPATH=/tmp/site
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
