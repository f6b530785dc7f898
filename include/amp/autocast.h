// amp/autocast.h: deprecated path, kept for code written against amp 0.1's README;
// the header is amp/precision/autocast.h.
#pragma once

#include "amp/precision/autocast.h"
