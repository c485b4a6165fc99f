// cli/template_print.h: `pinload inspect` of an I/O template file.
#pragma once

#include <string>

#include "pinload/io_template.h"

namespace pinload::cli {

// Whether `path` starts with the template magic (io_template.h). Never throws.
bool is_template_file(const std::string& path);

// Prints the template in `path` to stdout: its files, readers (pid, command,
// executable; version-2 templates) and, per destination, its reads in order
// with their reader. Throws IoError (unreadable) or InvalidFileError (not a
// well-formed template). The files' identity is not checked: a stale
// template prints as recorded.
void print_template(const std::string& path, bool json);

}  // namespace pinload::cli
