# Gunicorn config for the mlx-engined front-end.
#   gunicorn -c deploy/gunicorn.conf.py 'http_frontend.app:create_app()'
# Settings come from the environment (MLX_ENGINE_ENDPOINT, MLX_FRONTEND_HOST/PORT/WORKERS, ...);
# see `frontend --help`. The `frontend` command uses the same settings.
from http_frontend.gunicorn_settings import options

globals().update(options())
