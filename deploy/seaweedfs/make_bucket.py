"""Create an S3 bucket (argv[1]) at AWS_ENDPOINT_URL, waiting up to a minute for the
endpoint; a bucket that exists already is fine. The compose stack's s3-bucket service."""

import sys
import time

import boto3
from botocore.exceptions import BotoCoreError, ClientError


def main(bucket: str, wait_s: float = 60.0) -> int:
    client = boto3.client("s3")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.create_bucket(Bucket=bucket)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                break
            if time.monotonic() > deadline:
                print(f"cannot create bucket {bucket}: {exc}", file=sys.stderr)
                return 1
        except BotoCoreError as exc:
            if time.monotonic() > deadline:
                print(f"cannot reach {client.meta.endpoint_url}: {exc}", file=sys.stderr)
                return 1
        else:
            break
        time.sleep(1.0)
    print(f"bucket {bucket} ready at {client.meta.endpoint_url}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
