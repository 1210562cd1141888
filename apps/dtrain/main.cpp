#include "dtrain/build_info.hpp"
#include <cstdio>
int main() { std::printf("dtrain %s\n", dtrain::build_info::version); }
