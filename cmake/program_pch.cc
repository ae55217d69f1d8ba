// The translation unit that builds gpipe_program_pch's precompiled header (CMakeLists.txt).
