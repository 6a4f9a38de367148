// `meshfuse info`: version, build options, devices, kernel backends per device, and the
// op x backend x dtype table of every registered kernel.
#pragma once

#include <iosfwd>

namespace meshfuse::cli {

void print_info(std::ostream& out);

}  // namespace meshfuse::cli
