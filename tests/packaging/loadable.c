/* An ordinary shared library: what the doctor test preloads when libgpustitch.so is not built. */
int gpustitch_test_loadable(void) {
  return 1;
}
