/* bytecomp.h must stay plain C (C99) for C programs and ctypes bindings:
   this file compiles it as C and calls the library without a daemon. */
#include <bytecomp/bytecomp.h>
#include <stdio.h>
#include <string.h>

static int failures = 0;
#define CHECK(cond)                                             \
  do {                                                          \
    if (!(cond)) {                                              \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                               \
    }                                                           \
  } while (0)

int main(void) {
  bytecomp_connect_options o;
  bytecomp_client* c = NULL;
  bytecomp_connect_options_init(&o);
  CHECK(o.struct_size == sizeof o);
  CHECK(o.local_size == 1 && o.num_nodes == 1 && o.connect_timeout_ms == 10000);
  o.job_id = "c-test";
  o.socket_path = "/nonexistent/bytecomp/none.sock";
  CHECK(bytecomp_connect(&o, &c) == BYTECOMP_ERR_UNAVAILABLE);
  CHECK(c == NULL);
  CHECK(strstr(bytecomp_last_error(), "/nonexistent/bytecomp/none.sock") != NULL);
  CHECK(bytecomp_declare_tensor(NULL, "x", 1, BYTECOMP_FLOAT32, BYTECOMP_DEVICE_CPU, 0, NULL) ==
        BYTECOMP_ERR_INVALID_ARGUMENT);
  CHECK(bytecomp_close(NULL) == BYTECOMP_OK);
  CHECK(bytecomp_abi_version() == BYTECOMP_ABI_VERSION);
  CHECK(strcmp(bytecomp_status_name(BYTECOMP_ERR_UNSUPPORTED), "BYTECOMP_ERR_UNSUPPORTED") == 0);
  CHECK(bytecomp_dtype_size(BYTECOMP_INT64) == 8);
  return failures == 0 ? 0 : 1;
}
