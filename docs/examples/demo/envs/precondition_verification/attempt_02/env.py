"""A spec-built environment: the data below, run by spec_env.SpecEnv (sandbox/image/spec_env.py)."""
from spec_env import SpecEnv

SPEC = {'name': 'exact_arguments',
 'entities': {'ticket': {'count': [6, 10], 'fields': {'ticket_id': {'type': 'id', 'pattern': 'T{n:04d}'}}}},
 'task': {'record': {'type': 'pick', 'entity': 'ticket'},
          'stated_name': {'type': 'choice',
                          'values': [{'wrong': 'name_2387', 'right': 'name_1042'},
                                     {'wrong': 'name_3719', 'right': 'name_2387'},
                                     {'wrong': 'name_4560', 'right': 'name_3719'},
                                     {'wrong': 'name_5823', 'right': 'name_4560'},
                                     {'wrong': 'name_1042', 'right': 'name_5823'},
                                     {'wrong': 'name_3719', 'right': 'name_1042'},
                                     {'wrong': 'name_4560', 'right': 'name_2387'},
                                     {'wrong': 'name_5823', 'right': 'name_3719'},
                                     {'wrong': 'name_1042', 'right': 'name_4560'},
                                     {'wrong': 'name_2387', 'right': 'name_5823'},
                                     {'wrong': 'name_4560', 'right': 'name_1042'},
                                     {'wrong': 'name_5823', 'right': 'name_2387'},
                                     {'wrong': 'name_1042', 'right': 'name_3719'},
                                     {'wrong': 'name_2387', 'right': 'name_4560'},
                                     {'wrong': 'name_3719', 'right': 'name_5823'},
                                     {'wrong': 'name_5823', 'right': 'name_1042'},
                                     {'wrong': 'name_1042', 'right': 'name_2387'},
                                     {'wrong': 'name_2387', 'right': 'name_3719'},
                                     {'wrong': 'name_3719', 'right': 'name_4560'},
                                     {'wrong': 'name_4560', 'right': 'name_5823'}]},
          'stated_phone_number': {'type': 'choice',
                                  'values': ['555-1042', '555-2387', '555-3719', '555-4560', '555-5823']},
          'stated_relationship': {'type': 'choice',
                                  'values': ['relationship_1042',
                                             'relationship_2387',
                                             'relationship_3719',
                                             'relationship_4560',
                                             'relationship_5823']},
          'stated_is_self': {'type': 'bool', 'p': 0.5}},
 'tools': {'add_contact': {'kind': 'const', 'result': 'Done.'}},
 'system_prompt': 'You are a customer service agent. Use the tools to do what the user asks, then tell them. '
                  'Call each tool once, with exactly the values the user gives.',
 'user_message': 'Name, phone number, relationship, isSelf. My name is not {task.stated_name.wrong}, it is '
                 '{task.stated_name.right}. My phone number is {task.stated_phone_number}. My relationship '
                 'is {task.stated_relationship}. My is self is {task.stated_is_self}.',
 'reference': [{'call': 'add_contact',
                'args': {'name': '{task.stated_name.right}',
                         'phone_number': '{task.stated_phone_number}',
                         'relationship': '{task.stated_relationship}',
                         'is_self': '{task.stated_is_self}'}},
               {'reply': 'Done.'}],
 'reward': [{'name': 'every_value',
             'weight': 0.3,
             'pred': {'op': 'called',
                      'tool': 'add_contact',
                      'args': {'name': '{task.stated_name.right}',
                               'phone_number': '{task.stated_phone_number}',
                               'relationship': '{task.stated_relationship}',
                               'is_self': '{task.stated_is_self}'}}},
            {'name': 'first_try',
             'weight': 0.7,
             'pred': {'op': 'called',
                      'tool': 'add_contact',
                      'args': {'name': '{task.stated_name.right}',
                               'phone_number': '{task.stated_phone_number}',
                               'relationship': '{task.stated_relationship}',
                               'is_self': '{task.stated_is_self}'},
                      'only': True}}]}

TOOLS = [{'type': 'function',
  'function': {'name': 'add_contact',
               'description': 'Add a new contact person to contact database. Entries with identical '
                              'information are allowed,\n'
                              'and will be assigned different person_ids.',
               'parameters': {'type': 'object',
                              'properties': {'name': {'type': 'string',
                                                      'description': 'Name of contact person'},
                                             'phone_number': {'type': 'string',
                                                              'description': 'Phone number of contact '
                                                                             'person'},
                                             'relationship': {'type': 'string',
                                                              'description': 'Optional, relationship between '
                                                                             'user and this contact'},
                                             'is_self': {'type': 'boolean',
                                                         'description': 'Optional. Defaults to False. Should '
                                                                        'be set to True if the contact '
                                                                        'corresponds to the current user.'}},
                              'required': ['name', 'phone_number']}}}]

POLICY = "Don't make assumptions about what values to plug into functions. Ask for clarification if a user request is ambiguous."


class Env(SpecEnv):
    SPEC = SPEC
    TOOLS = TOOLS
    POLICY = POLICY
