// amp/region.h: deprecated path, kept for code written against amp 0.1's README;
// the header is amp/precision/region.h.
#pragma once

#include "amp/precision/region.h"
