-- Argo CD health check for vllm.autotuner.io/VLLMDeployment (vllm-autotuner, docs/gitops.md).
--
-- kstatus-like: a status older than the spec is Progressing, Degraded=True is Degraded, and
-- Ready=True is Healthy. Ready stays True while the operator tunes in the background
-- (Tuning=True), so an Application is not held in Progressing for as long as tuning runs; the
-- message tells what the tuner is doing. Written for Argo CD's default sandbox (base and table
-- libraries only: no string library).
local hs = {}

local function findCondition(conditions, conditionType)
  if conditions == nil then
    return nil
  end
  for _, condition in ipairs(conditions) do
    if condition.type == conditionType then
      return condition
    end
  end
  return nil
end

local function messageOf(condition, fallback)
  if condition ~= nil and condition.message ~= nil and condition.message ~= "" then
    return condition.message
  end
  return fallback
end

if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe the VLLMDeployment"
  return hs
end

local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local conditions = obj.status.conditions
local degraded = findCondition(conditions, "Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  if degraded.reason ~= nil and degraded.reason ~= "" then
    hs.message = degraded.reason .. ": " .. messageOf(degraded, "degraded")
  else
    hs.message = messageOf(degraded, "Degraded")
  end
  return hs
end

local ready = findCondition(conditions, "Ready")
if ready == nil or ready.status ~= "True" then
  hs.status = "Progressing"
  hs.message = messageOf(ready, "Waiting for the vLLM pods to become available")
  return hs
end

hs.status = "Healthy"
hs.message = messageOf(ready, "vLLM is serving")
local tuning = findCondition(conditions, "Tuning")
if tuning ~= nil and tuning.status == "True" then
  local phase = nil
  if obj.status.tuning ~= nil then
    phase = obj.status.tuning.phase
  end
  if phase ~= nil then
    hs.message = hs.message .. "; tuning in the background (" .. phase .. ")"
  else
    hs.message = hs.message .. "; tuning in the background"
  end
end
return hs
