// Prints a fresh CURVE key pair for the `transport.curve` config section.
#include <zmq.h>

#include <cstdio>

int main() {
  char pub[41], sec[41];
  if (zmq_curve_keypair(pub, sec) != 0) {
    std::fprintf(stderr, "bytecomp-transport-keygen: %s\n", zmq_strerror(zmq_errno()));
    return 1;
  }
  std::printf("curve:\n  enabled: true\n  public_key: \"%s\"\n  secret_key: \"%s\"\n", pub, sec);
  return 0;
}
