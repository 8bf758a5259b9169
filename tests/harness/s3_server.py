"""A real S3-compatible server for the object-storage tests: moto's S3 in server mode, on a free localhost port in a
thread of the test process, reached over HTTP by s3fs in the training processes exactly as AWS would be. A request
hook lets a test hold or fail chosen requests (a save killed mid-way, a failed upload) on the server's side."""

import logging
import threading
from collections.abc import Callable, Iterable

import moto.settings
from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "titan-test", "AWS_SECRET_ACCESS_KEY": "titan-test",
               "AWS_DEFAULT_REGION": "us-east-1",
               # no instance-metadata lookups for credentials (a second each where there is no EC2)
               "AWS_EC2_METADATA_DISABLED": "true"}

Hook = Callable[[str, str], int | None]
"""(method, path) -> an HTTP status to answer with instead of serving the request, or None to serve it. It may
block, holding the request."""


class S3Server:
    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.hook: Hook | None = None
        backend = DomainDispatcherApplication(create_backend_app)

        def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
            status = self.hook(environ["REQUEST_METHOD"], environ["PATH_INFO"]) if self.hook else None
            if status is None:
                return backend(environ, start_response)
            start_response(f"{status} Injected", [("Content-Type", "text/plain")])
            return [b"injected by the test"]

        self.server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        host, port = self.server.server_address[:2]
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
        """What a process needs to reach the server: credentials and the endpoint, as a user's environment."""

    def require_authentication(self, enabled: bool) -> None:
        """Check every request's access key against moto's IAM (which knows none), as AWS does; by default moto
        accepts any key."""
        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0 if enabled else float("inf")

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join()
